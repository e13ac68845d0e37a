"""Who is calling: sign-in gate, Host allow-list and CSRF checks for every request.

:func:`install` adds a pure ASGI middleware (so it covers pages, htmx fragments, ``/api``, ``/v1``,
SSE and streaming responses, and never reads a multipart upload's body) that, per request:

1. refuses a ``Host`` header not in the allow-list (400, plain text; against DNS rebinding);
2. resolves the caller into ``request.state.user`` (a ``User`` or None) from
   ``Authorization: Bearer <API key "wk-..." or access token>`` or the signed session cookie;
3. sends anonymous callers of non-public paths a 401 in the surface's error shape (``/api``,
   ``/v1``, ``*/events``), a 401 "you were signed out" message swapped into the page (htmx: no
   navigation) or a 303 to ``/login?next=<the page>`` (pages; :mod:`app.web.signed_out`);
4. checks CSRF on cookie-signed unsafe methods: the session's token in ``X-CSRF-Token`` or the
   ``csrf_token`` form field (urlencoded bodies; the first field of multipart bodies, see
   :mod:`app.web.csrf`), and an ``Origin``/``Referer`` equal to the request's own
   ``scheme://host``. The sign-in forms (``/login``, ``/setup``) need the pre-session token of
   :mod:`app.web.csrf` instead (login CSRF). Bearer calls are exempt;
5. adds ``X-Frame-Options: DENY`` and ``Content-Security-Policy: frame-ancestors 'none'`` to
   every response (no framing: against clickjacking), and ``Cache-Control: no-store`` to every
   non-static response of a signed-in caller and to the sign-in, setup and account pages (Back
   after signing out never shows a signed-in page or a new API key from the browser's cache).

A Bearer value that is sent but matches no live API key or access token gets a 401 saying so
("invalid or revoked ..."), in the surface's error shape, not the "sign in first" answer; an
unrevoked API key of a disabled account is told that instead (code ``account_disabled``).
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import defaultdict, deque
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated
from urllib.parse import parse_qs, urlsplit

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, RedirectResponse, Response
from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.settings import Settings
from app.store.schema import User
from app.studio import accounts, first_start
from app.studio.errors import StudioError
from app.web import csrf
from app.web import signed_out
from app.web.errors import error_response

log = logging.getLogger("whetstone.web")

COOKIE = "whetstone_session"
PUBLIC = ("/login", "/logout", "/setup", "/healthz", "/api/login/access-token", "/api/docs",
          "/api/openapi.json")
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
UNSAFE = ("POST", "PUT", "PATCH", "DELETE")
NO_STORE = ("/login", "/setup", "/account")  # never cached, signed in or not
SECURITY_HEADERS = {"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"}
INVALID_BEARER = "invalid or revoked API key or access token"


def is_public(path: str) -> bool:
    """Paths served without signing in (sign-in, setup, static files, health, API docs)."""
    return path in PUBLIC or path.startswith("/static/")


def allowed_hosts(settings: Settings) -> set[str] | None:
    """Lower-case host names served (None = any), from ``settings.allowed_hosts``."""
    raw = [h.strip().lower() for h in settings.allowed_hosts.split(",") if h.strip()]
    if "*" in raw:
        return None
    if raw:
        return set(raw)
    names = {"127.0.0.1", "localhost", "[::1]"}
    if settings.host not in ("0.0.0.0", "::", ""):
        names.add(f"[{settings.host}]" if ":" in settings.host else settings.host.lower())
    return names


def _host_name(host_header: str) -> str:
    h = host_header.strip().lower()
    if h.startswith("["):
        return h.split("]")[0] + "]"
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def secret_key(settings: Settings) -> str:
    """``settings.secret_key``, else the key in ``<data_dir>/secret_key`` (created once, 0600)."""
    if settings.secret_key:
        return settings.secret_key
    path = Path(settings.data_dir) / "secret_key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".secret_key.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48))
        try:
            os.link(tmp, path)  # fails if another process won the race: use theirs
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text().strip()


class LoginLimiter:
    """In-memory sign-in attempt counters over a sliding minute: per (client address, user name)
    (``per_minute``) and per client address across all names (``per_address``; a successful
    sign-in takes its attempt back, so only failures add up there)."""

    def __init__(self, per_minute: int, per_address: int | None = None):
        self.per_minute = per_minute
        self.per_address = per_address or per_minute * 3
        self._hits: dict[tuple[str, str | None], deque[float]] = defaultdict(deque)
        self._lock = threading.Lock()

    def _wait(self, key: tuple[str, str | None], limit: int, t: float) -> float:
        q = self._hits[key]
        while q and q[0] <= t - 60:
            q.popleft()
        return max(1.0, 60 - (t - q[0])) if len(q) >= limit else 0.0

    def hit(self, ip: str, name: str) -> float:
        """Count an attempt; returns 0 when allowed, else the seconds to wait (Retry-After)."""
        t = time.monotonic()
        pair = (ip, (name or "").strip().lower())
        with self._lock:
            wait = max(self._wait(pair, self.per_minute, t),
                       self._wait((ip, None), self.per_address, t))
            if wait:
                return wait
            self._hits[pair].append(t)
            self._hits[(ip, None)].append(t)
        return 0.0

    def clear(self, ip: str, name: str) -> None:
        """After a successful sign-in: forget the attempts of (ip, name), and take this attempt
        back from the address's count."""
        with self._lock:
            self._hits.pop((ip, (name or "").strip().lower()), None)
            q = self._hits.get((ip, None))
            if q:
                q.pop()


def _serializer(app) -> URLSafeTimedSerializer:
    return app.state.auth_serializer


def set_session_cookie(request: Request, response: Response, token: str) -> None:
    """Put the signed session ``token`` on ``response``: HttpOnly, SameSite=Lax, Secure over
    https, Max-Age = ``settings.session_hours``."""
    settings: Settings = request.app.state.settings
    response.set_cookie(COOKIE, _serializer(request.app).dumps(token),
                        max_age=int(settings.session_hours * 3600), httponly=True,
                        samesite="lax", secure=request.url.scheme == "https", path="/")


def clear_session_cookie(response: Response) -> None:
    """Delete the session cookie on ``response``."""
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="lax")


def session_token(request: Request) -> str | None:
    """The session token inside the request's signed cookie (None if absent or tampered)."""
    raw = request.cookies.get(COOKIE)
    if not raw:
        return None
    hours = request.app.state.settings.session_hours
    try:
        return _serializer(request.app).loads(raw, max_age=int(hours * 3600))
    except BadSignature:
        return None


def current_token(request: Request) -> str | None:
    """The sign-in token the request came with: its session cookie's, else a Bearer access token
    (None for an API key or no sign-in)."""
    token = session_token(request)
    if token:
        return token
    auth = request.headers.get("authorization", "")
    cred = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    return cred if cred and not cred.startswith(accounts.KEY_PREFIX) else None


def current_user(request: Request) -> User:
    """The signed-in caller. Raises StudioError unauthorized when there is none."""
    user = getattr(request.state, "user", None)
    if user is None:
        raise StudioError("unauthorized", "sign in first (a session, or Authorization: Bearer "
                                          "with an API key or access token)")
    return user


def admin_user(request: Request) -> User:
    """The signed-in caller if an admin. Raises StudioError unauthorized or forbidden."""
    user = current_user(request)
    if user.role != "admin":
        raise StudioError("forbidden", "only an admin may do this")
    return user


CurrentUser = Annotated[User, Depends(current_user)]
AdminUser = Annotated[User, Depends(admin_user)]


def csrf_token(request: Request) -> str | None:
    """The CSRF token of the request's browser session (None without one); templates put it
    in ``<meta name="csrf-token">``, htmx's ``hx-headers`` and hidden ``csrf_token`` fields."""
    return getattr(request.state, "csrf_token", None)


def resolve(engine, request: Request):
    """``(user, token row, method)`` for the request's credentials: a Bearer API key or access
    token (method ``"bearer"``) or the session cookie (``"cookie"``); ``(None, None, method)``
    when they name no live, enabled user."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        cred = auth[7:].strip()
        if cred.startswith(accounts.KEY_PREFIX):
            return accounts.user_for_api_key(engine, cred), None, "bearer"
        found = accounts.session_for_token(engine, cred)
        return (found[0], found[1], "bearer") if found else (None, None, "bearer")
    token = session_token(request)
    found = accounts.session_for_token(engine, token) if token else None
    if found and found[1].kind == "session":
        return found[0], found[1], "cookie"
    return None, None, None


def still_signed_in(request: Request) -> bool:
    """Whether the credentials that opened ``request`` still name the same live, enabled user
    (a long stream re-checks this: sign-out, revocation or disabling ends it). Blocking."""
    user = getattr(request.state, "user", None)
    now_user = resolve(request.app.state.engine, request)[0]
    return user is not None and now_user is not None and now_user.id == user.id


class AuthMiddleware:
    """The ASGI middleware described in the module docstring (added by :func:`install`)."""

    def __init__(self, app: ASGIApp, settings: Settings, engine):
        self.app, self.settings, self.engine = app, settings, engine
        self.hosts = allowed_hosts(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        path = scope["path"]
        no_store = path in NO_STORE or path.startswith("/account/")
        presession_cookie = None  # Set-Cookie of a new pre-session token (sign-in forms)
        inner_send = send

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    if name not in headers:
                        headers[name] = value
                if no_store:
                    headers["Cache-Control"] = "no-store"
                if presession_cookie:
                    headers.append("set-cookie", presession_cookie)
            await inner_send(message)

        host = _host_name(request.headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts:
            refusal = PlainTextResponse(f"Host {host!r} is not served here; add it to "
                                        "WHETSTONE_ALLOWED_HOSTS", status_code=400)
            await refusal(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        user, row, method = await run_in_threadpool(resolve, self.engine, request)
        state.update(user=user, auth_method=method, csrf_token=row.csrf_token if row and
                     row.kind == "session" and method == "cookie" else None)
        no_store = no_store or (user is not None and not path.startswith("/static/"))
        presession = csrf.presession_token(request) if path in csrf.LOGIN_FORMS else None
        if path in csrf.LOGIN_FORMS and presession is None and scope["method"] == "GET":
            presession, presession_cookie = csrf.new_presession_cookie(request.url.scheme ==
                                                                       "https")
        if user is None and presession:
            state["csrf_token"] = presession  # the sign-in form's hidden field
        if user is None and method == "bearer" and not is_public(path):
            disabled = await run_in_threadpool(accounts.disabled_owner, self.engine,
                                               request.headers["authorization"][7:].strip())
            await (error_response(request, 401, accounts.DISABLED, code="account_disabled")
                   if disabled else error_response(request, 401, INVALID_BEARER,
                                                   code="invalid_api_key"))(scope, receive, send)
            return
        if user is None and not is_public(path):
            await self._anonymous(request)(scope, receive, send)
            return
        if scope["method"] in UNSAFE and method != "bearer":
            expected = presession if path in csrf.LOGIN_FORMS else state["csrf_token"]
            problem, receive = await self._csrf_problem(request, receive, expected)
            if problem:
                await error_response(request, 403, f"CSRF check failed: {problem}",
                                     code="csrf_failed")(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _anonymous(request: Request) -> Response:
        path = request.url.path
        if path.startswith(("/api/", "/v1/")) or path in ("/api", "/v1") or \
                path.endswith("/events"):
            return error_response(request, 401, "sign in first: send Authorization: Bearer "
                                  "<API key or access token>", code="unauthorized")
        # htmx: an in-page message, never a navigation (it would discard a half-filled form);
        # ``next`` is the page, never a fragment or POST endpoint (app/web/signed_out.py)
        if request.headers.get("hx-request", "").lower() == "true":
            return signed_out.htmx_response(request)
        return RedirectResponse(signed_out.login_url(request), status_code=303)

    async def _csrf_problem(self, request: Request, receive: Receive,
                            expected: str | None) -> tuple[str | None, Receive]:
        own = f"{request.url.scheme}://{request.headers.get('host', '')}".lower()
        origin = request.headers.get("origin") or request.headers.get("referer")
        if origin:
            parts = urlsplit(origin)
            if f"{parts.scheme}://{parts.netloc}".lower() != own:
                return f"the request came from another origin ({origin})", receive
        if expected is None and request.url.path in csrf.LOGIN_FORMS:
            return ("the sign-in form's token cookie is missing (allow cookies for this site "
                    "and reload the page)"), receive
        if expected is None:  # anonymous, not a sign-in form: no session to protect
            return None, receive
        given = request.headers.get("x-csrf-token")
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if not given and ctype == "multipart/form-data":
            given, receive = await csrf.multipart_field(receive,
                                                        request.headers.get("content-type", ""))
        elif not given and ctype == "application/x-www-form-urlencoded":
            body, receive = await _buffer_body(receive)
            given = (parse_qs(body.decode("latin-1")).get("csrf_token") or [None])[0]
        if not given:
            return ("missing token (send the X-CSRF-Token header or the csrf_token form "
                    "field; reload the page)"), receive
        if not secrets.compare_digest(given, expected):
            return "the token does not match this session (reload the page)", receive
        return None, receive


async def _buffer_body(receive: Receive) -> tuple[bytes, Receive]:
    """Read a (small, urlencoded) body and return it with a ``receive`` that replays it."""
    chunks, more = [], True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    body = b"".join(chunks)
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


def _startup(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    engine = app.state.engine
    if settings.admin_password:
        user = first_start.ensure_admin(engine, settings.admin_user, settings.admin_password)
        log.info("admin %r is ready (WHETSTONE_ADMIN_PASSWORD)", user.name)
        return
    if accounts.has_users(engine):
        return
    if settings.host not in LOOPBACK and not settings.host.startswith("127."):
        msg = (f"Whetstone has no users yet and binds {settings.host}, so anyone who reaches it "
               "could claim the admin account. Set WHETSTONE_ADMIN_PASSWORD (and optionally "
               "WHETSTONE_ADMIN_USER) to create the admin, or start once on 127.0.0.1 and open "
               "the setup link printed there.")
        print(msg, flush=True)
        raise RuntimeError(msg)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    link = f"http://{host}:{settings.port}/setup?token={first_start.setup_token(engine)}"
    log.warning("no users yet: open %s to create the admin account (one-time link)", link)
    print(f"\n  Whetstone: create the admin account at {link}\n", flush=True)


def install(app: FastAPI) -> None:
    """Add sign-in, Host allow-list and CSRF checks to ``app`` (call once in ``create_app``,
    after ``app.state.settings`` and ``app.state.engine`` are set).

    Also: wraps the app's lifespan so that, after migrations, ``WHETSTONE_ADMIN_PASSWORD``
    creates/resets the admin, or a first start prints the one-time setup link (and refuses to
    start on a non-loopback ``host`` with no users: RuntimeError); registers the Jinja global
    ``csrf_token(request)``; and a StudioError handler if the app has none yet.
    """
    settings: Settings = app.state.settings
    app.state.auth_serializer = URLSafeTimedSerializer(secret_key(settings), salt="session")
    app.state.login_limiter = LoginLimiter(settings.login_attempts_per_minute,
                                           settings.login_attempts_per_address_per_minute)
    app.add_middleware(AuthMiddleware, settings=settings, engine=app.state.engine)

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            await run_in_threadpool(_startup, app)
            yield state

    app.router.lifespan_context = lifespan

    from app.web.render import env

    env.globals["csrf_token"] = csrf_token
    if StudioError not in app.exception_handlers:
        from app.web.errors import error_response as _resp

        statuses = {"not_found": 404, "invalid": 422, "unauthorized": 401, "forbidden": 403,
                    "conflict": 409, "too_many": 429, "unavailable": 503}

        async def _studio(request: Request, exc: StudioError):
            return _resp(request, statuses[exc.kind], exc.message, exc.field, exc.kind)

        app.add_exception_handler(StudioError, _studio)
