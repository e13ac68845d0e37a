"""Error responses: the OpenAI error shape under /v1, JSON under /api, a friendly page elsewhere.

No traceback ever reaches a user; unexpected errors are logged with theirs.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.store.db import LOCKED, fault_of
from app.store.queue import JobNotFound
from app.store.repo import NotFound

log = logging.getLogger("whetstone.web")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error"}


class ApiError(Exception):
    """An error with an HTTP status, rendered in the shape the path expects."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def openai_error(status: int, message: str, param: str | None = None,
                 code: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with ``status``."""
    etype = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": etype, "param": param,
                                   "code": code}}, status_code=status)


def _kind(request: Request) -> str:
    p = request.url.path
    if p.startswith("/v1/") or p == "/v1":
        return "openai"
    if p.startswith("/api/") or p == "/healthz" or p.endswith("/events"):
        return "json"
    return "html"


def error_response(request: Request, status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse | HTMLResponse:
    kind = _kind(request)
    if kind == "openai":
        return openai_error(status, message, param, code)
    if kind == "json":
        return JSONResponse({"error": {"message": message, "param": param, "code": code}},
                            status_code=status)
    from app.web.render import env

    html = env.get_template("error.html").render(request=request, status=status, message=message,
                                                 path=request.url.path)
    return HTMLResponse(html, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    first = errs[0]
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def install(app: FastAPI) -> None:
    """Register the exception handlers on ``app``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(request, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound):
        return error_response(request, 404, str(exc), code="not_found")

    @app.exception_handler(JobNotFound)
    async def _job_not_found(request: Request, exc: JobNotFound):
        return error_response(request, 404, f"no job with id {exc.args[0]!r}", code="not_found")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and msg == "Not Found":
            msg = f"nothing at {request.url.path}"
        return error_response(request, exc.status_code, msg)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(request, 400 if _kind(request) == "openai" else 422, msg, param,
                              "invalid_value")

    async def _fault(request: Request, exc: Exception):
        # faults (issue 20): a database locked past the busy timeout is 503 "busy, retry"
        # (Retry-After), a full disk 507; anything else is unexpected
        fault = fault_of(exc)
        if fault is None:
            return await _unexpected(request, exc)
        log.warning("%s on %s %s: %s", fault, request.method, request.url.path, exc)
        if fault == LOCKED:
            resp = error_response(request, 503, "The studio is busy (its database is locked by "
                                  "another writer); retry in a few seconds.", code="busy_retry")
            resp.headers["Retry-After"] = "5"
            return resp
        return error_response(request, 507, "The server's disk is full; nothing was saved. "
                              "Ask an admin to free space in the data dir.", code="disk_full")

    app.add_exception_handler(SQLAlchemyError, _fault)
    app.add_exception_handler(OSError, _fault)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(request, 500, "Something went wrong on the server; the error was "
                              "logged. Please try again or check the server log.",
                              code="server_error")
