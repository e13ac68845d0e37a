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
from app.studio.errors import FieldErrors, StudioError
from app.web.uploads import UploadError

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


async def request_json(request: Request):
    """The request body parsed as JSON (any JSON value). Raises ApiError 400 "the request body is
    not valid JSON", or, for an integer of more digits than Python converts (4300), a message
    that says so: the body is JSON, but no field takes a number that large."""
    try:
        return await request.json()
    except (ValueError, RecursionError) as exc:
        if "integer string conversion" in str(exc):
            raise ApiError(400, "the request body has a number of more than 4300 digits: no field "
                                "takes a number that large") from None
        raise ApiError(400, "the request body is not valid JSON") from None


def conflict_of(action, *args) -> str | None:
    """Call ``action(*args)`` for a page's card: None when it succeeds, the message of the
    ``StudioError("conflict")`` it raises (shown on the card, answered 409); any other error
    propagates (404 and the rest, as every page)."""
    try:
        action(*args)
    except StudioError as exc:
        if exc.kind != "conflict":
            raise
        return exc.message
    return None


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


#: HTTP status of each StudioError kind (``invalid`` is 400 under /v1, as OpenAI answers).
STATUS = {"not_found": 404, "invalid": 422, "unauthorized": 401, "forbidden": 403,
          "conflict": 409, "too_many": 429, "unavailable": 503}
#: /v1 names of our spec fields, and the OpenAI error codes of what is missing.
OPENAI_PARAMS = {"num_train_epochs": "hyperparameters.n_epochs",
                 "per_device_train_batch_size": "hyperparameters.batch_size",
                 "learning_rate_multiplier": "hyperparameters.learning_rate_multiplier",
                 "dataset": "training_file"}
_OPENAI_CODES = {("not_found", "model"): "model_not_found",
                 ("not_found", "dataset"): "file_not_found",
                 ("invalid", "dataset"): "invalid_file", ("invalid", "file"): "invalid_file",
                 ("forbidden", None): "permission_denied", ("unauthorized", None): "invalid_api_key",
                 ("conflict", None): "conflict", ("too_many", None): "rate_limit_exceeded"}


def studio_error_response(request: Request, exc: StudioError) -> JSONResponse | HTMLResponse:
    """The one mapping of a use-case error to HTTP for every surface: the status from its kind,
    its field as ``param`` (renamed to the OpenAI parameter under /v1), an error code. A spec
    that failed validation names its field in the message too, and lists every bad field under
    ``fields`` on /api."""
    status = STATUS[exc.kind]
    fields = exc.fields if isinstance(exc, FieldErrors) else None
    if _kind(request) == "openai":
        if exc.kind == "invalid":
            status = 400
        field = exc.field
        code = (exc.code or _OPENAI_CODES.get((exc.kind, field))
                or _OPENAI_CODES.get((exc.kind, None))
                or ("not_found" if exc.kind == "not_found" else "invalid_value"))
        if field and field.startswith("rewards"):  # graders became our rewards
            field = "method.reinforcement.grader"
        param = OPENAI_PARAMS.get(field, field)
        message = f"{param}: {exc.message}" if param and fields is not None else exc.message
        return openai_error(status, message, param, code)
    code = exc.code or {"invalid": "invalid_value", "not_found": "not_found"}.get(exc.kind, exc.kind)
    message = f"{exc.field}: {exc.message}" if exc.field and fields is not None else exc.message
    if _kind(request) == "json" and fields:
        return JSONResponse({"error": {"message": message, "param": exc.field, "code": code,
                                       "fields": fields}}, status_code=status)
    return error_response(request, status, message, exc.field, code)


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

    @app.exception_handler(StudioError)
    async def _studio_error(request: Request, exc: StudioError):
        return studio_error_response(request, exc)

    @app.exception_handler(UploadError)
    async def _upload_error(request: Request, exc: UploadError):
        return error_response(request, exc.status, exc.message, exc.param, "invalid_file")

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
