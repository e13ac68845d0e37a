"""CSRF tokens that :mod:`app.web.auth` checks besides a session's own token.

* **Sign-in forms** (``/login``, ``/setup``) have no session yet, so they use a pre-session
  token (double-submit): a GET of the form sets the random token in the HttpOnly, SameSite=Lax
  cookie :data:`PRESESSION_COOKIE` and renders it in the form's hidden ``csrf_token`` field; a
  POST must send the same value. A third-party page can neither read the cookie nor send it on a
  cross-site POST, so it cannot sign a visitor into another account ("login CSRF"). The OAuth2
  password endpoint ``/api/login/access-token`` (scripts, no browser) is not such a form.
* **Multipart uploads** carry the session's token as their *first* form field, which
  :func:`multipart_field` reads from the head of the body (at most :data:`HEAD_LIMIT` bytes,
  replayed unchanged to the route) before the file streams in: the token never goes in the URL,
  hence never in an access log. A ``csrf_token`` query parameter is not read; should a stale page
  or a script still put one in a URL, :class:`RedactTokens` (installed on uvicorn's access log by
  ``app.web.main.server_config``) writes it as ``csrf_token=[redacted]``.
"""
from __future__ import annotations

import logging
import re
import secrets

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive

PRESESSION_COOKIE = "whetstone_signin_csrf"
#: Paths whose POST is checked against the pre-session token.
LOGIN_FORMS = ("/login", "/setup")
#: Lifetime of the pre-session cookie (seconds): a sign-in page left open this long needs a reload.
PRESESSION_MAX_AGE = 7 * 24 * 3600
#: Most bytes of a multipart body read to find its first field.
HEAD_LIMIT = 64 * 1024
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{32,64}$")
_IN_URL = re.compile(r"(?i)\b(csrf_token=)[^&\s\"]*")


class RedactTokens(logging.Filter):
    """A logging filter that replaces the value of every ``csrf_token=`` in a record's message
    and string arguments (uvicorn's access line: client, method, path with query, ...) by
    ``[redacted]``. Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_IN_URL.sub(r"\1[redacted]", a) if isinstance(a, str) else a
                                for a in record.args)
        if isinstance(record.msg, str):
            record.msg = _IN_URL.sub(r"\1[redacted]", record.msg)
        return True


def redact_access_log(logger_name: str = "uvicorn.access") -> None:
    """Add one :class:`RedactTokens` to the logger ``logger_name`` (idempotent)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, RedactTokens) for f in logger.filters):
        logger.addFilter(RedactTokens())


def presession_token(request: Request) -> str | None:
    """The pre-session token in the request's cookie (None when absent or malformed)."""
    raw = request.cookies.get(PRESESSION_COOKIE, "")
    return raw if _TOKEN.match(raw) else None


def new_presession_cookie(secure: bool) -> tuple[str, str]:
    """``(token, Set-Cookie header value)`` for a fresh pre-session token (43 url-safe chars)."""
    token = secrets.token_urlsafe(32)
    resp = Response()
    resp.set_cookie(PRESESSION_COOKIE, token, max_age=PRESESSION_MAX_AGE, httponly=True,
                    samesite="lax", secure=secure, path="/")
    return token, resp.headers["set-cookie"]


def _boundary(content_type: str) -> bytes | None:
    m = re.search(r'boundary="?([^";]+)"?', content_type, re.IGNORECASE)
    return m.group(1).encode("latin-1") if m else None


def _first_field(head: bytes, boundary: bytes, name: str) -> tuple[str | None, bool]:
    """``(value, complete)``: the first part's value when it is the plain field ``name``;
    ``complete`` is False while ``head`` may still be too short to tell."""
    start = b"--" + boundary + b"\r\n"
    if len(head) < len(start):
        return None, False
    if not head.startswith(start):
        return None, True
    split = head.find(b"\r\n\r\n", len(start))
    if split < 0:
        return None, False
    headers = head[len(start):split].decode("latin-1").lower()
    disposition = next((h for h in headers.split("\r\n")
                        if h.startswith("content-disposition:")), "")
    if f'name="{name}"' not in disposition or "filename=" in disposition:
        return None, True
    end = head.find(b"\r\n--" + boundary, split + 4)
    if end < 0:
        return None, False
    return head[split + 4:end].decode("utf-8", "replace"), True


async def multipart_field(receive: Receive, content_type: str,
                          name: str = "csrf_token") -> tuple[str | None, Receive]:
    """The value of ``name`` when it is the first field of a multipart body (else None), and a
    ``receive`` that replays the bytes read (at most :data:`HEAD_LIMIT`) then the rest.

    Only the body's head is held in memory; the file that follows streams through untouched.
    """
    boundary = _boundary(content_type)
    if boundary is None:
        return None, receive
    head, more, value, done = b"", True, None, False
    ended: Message | None = None
    while more and not done and len(head) < HEAD_LIMIT:
        msg = await receive()
        if msg["type"] != "http.request":
            ended = msg
            break
        head += msg.get("body", b"")
        more = msg.get("more_body", False)
        value, done = _first_field(head, boundary, name)
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if ended is not None and not head:
                return ended
            return {"type": "http.request", "body": head, "more_body": more and ended is None}
        if ended is not None:
            return ended
        return await receive()

    return value, replay
