"""Sign-in, first-start setup, the account page (API keys, password), the admin page, and their
JSON twins under ``/api`` (OAuth2 password flow for access tokens, users, keys, ``/api/me``).

The account and admin forms are POST-redirect-GET: a success answers 303 to the page, which
shows the result once (:mod:`app.web.flash`; a new API key's plaintext included); a GET of a
form's URL goes to its page. A refused form is shown again at once with its error, except the
add-user form's, which redirects too (its typed values and errors shown once)."""
from __future__ import annotations

import json
import math
from typing import Annotated, Literal
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.security import OAuth2PasswordRequestForm
from pydantic import BaseModel, ConfigDict
from sqlalchemy.engine import Engine

from app.store.events import parse_id
from app.store.schema import ApiKey, User
from app.studio import accounts, audit, first_start
from app.studio.errors import StudioError, field_messages
from app.web import auth, flash
from app.web.auth import AdminUser, CurrentUser
from app.web.deps import is_htmx
from app.web.errors import error_response
from app.web.render import render

router = APIRouter()
_STATUS = {"not_found": 404, "invalid": 422, "unauthorized": 401, "forbidden": 403,
           "conflict": 409, "too_many": 429, "unavailable": 503}


def status_for(exc: StudioError) -> int:
    """The HTTP status of a StudioError on these pages (same mapping as the API)."""
    return _STATUS[exc.kind]


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _safe_next(nxt: str | None) -> str:
    """A same-site path to go to after sign-in (never another host)."""
    if nxt and nxt.startswith("/") and not nxt.startswith(("//", "/\\")):
        return nxt
    return "/"


def _throttle(request: Request, name: str) -> float:
    ip = request.client.host if request.client else "?"
    return request.app.state.login_limiter.hit(ip, name)


def _wait_s(wait: float) -> int:
    """Whole seconds to wait before the next sign-in attempt (at least 1)."""
    return max(1, math.ceil(wait))


def _too_many(wait: float) -> dict[str, str]:
    return {"Retry-After": str(_wait_s(wait))}


def _unthrottle(request: Request, name: str) -> None:
    request.app.state.login_limiter.clear(request.client.host if request.client else "?", name)


def _signed_in(request: Request, user: User, to: str) -> RedirectResponse:
    token, _ = accounts.new_token(_engine(request), user, "session",
                                  request.app.state.settings.session_hours)
    resp = RedirectResponse(to, status_code=303)
    auth.set_session_cookie(request, resp, token)
    return resp


# ---- sign-in pages -------------------------------------------------------------------------
@router.get("/login")
def login_page(request: Request, next: str = "/"):
    if request.state.user is not None:
        return RedirectResponse(_safe_next(next), status_code=303)
    if not accounts.has_users(_engine(request)):
        return render(request, "login.html", {"next": next, "no_users": True})
    # a browser whose account was disabled is sent here; say why (trial s27)
    token = auth.session_token(request)
    if token and accounts.disabled_owner(_engine(request), token):
        return render(request, "login.html", {"next": next, "error": accounts.DISABLED})
    return render(request, "login.html", {"next": next})


@router.post("/login")
def login_submit(request: Request, username: Annotated[str, Form()] = "",
                 password: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/"):
    ctx = {"next": next, "username": username}
    wait = _throttle(request, username)
    if wait:
        return render(request, "login.html", {**ctx, "error": "Too many sign-in attempts; try "
                      f"again in {_wait_s(wait)} s."}, status_code=429, headers=_too_many(wait))
    try:
        user = accounts.authenticate(_engine(request), username, password)
    except StudioError as exc:
        return render(request, "login.html", {**ctx, "error": exc.message},
                      status_code=status_for(exc))
    _unthrottle(request, username)
    return _signed_in(request, user, _safe_next(next))


@router.post("/logout")
def logout(request: Request):
    token = auth.session_token(request)
    if token:
        accounts.end_token(_engine(request), token)
    resp = RedirectResponse("/login", status_code=303)
    auth.clear_session_cookie(resp)
    return resp


@router.get("/setup")
def setup_page(request: Request, token: str = ""):
    if not first_start.setup_token_valid(_engine(request), token):
        return error_response(request, 404, "This setup link is not valid: the studio is already "
                              "set up, or the link was used or has expired.")
    return render(request, "setup.html", {"token": token})


@router.post("/setup")
def setup_submit(request: Request, token: Annotated[str, Form()] = "",
                 name: Annotated[str, Form()] = "", password: Annotated[str, Form()] = "",
                 password2: Annotated[str, Form()] = ""):
    ctx = {"token": token, "name": name}
    try:
        user = first_start.complete_setup(_engine(request), token, name, password, password2)
    except StudioError as exc:
        if exc.kind == "not_found":
            return error_response(request, 404, exc.message)
        return render(request, "setup.html", {**ctx, "errors": field_messages(exc)},
                      status_code=status_for(exc))
    return _signed_in(request, user, "/")


# ---- account page --------------------------------------------------------------------------
def _account(request: Request, user: User, status: int = 200,
             headers: dict[str, str] | None = None, **extra) -> Response:
    keys = accounts.list_api_keys(_engine(request), user)
    sessions = accounts.list_sign_ins(_engine(request), user, auth.current_token(request))
    return render(request, "account.html", {"user": user, "keys": keys, "sessions": sessions,
                                            **extra}, status_code=status, headers=headers)


def _to(page: str, request: Request, **message) -> RedirectResponse:
    """303 to ``page``, which shows ``message`` once."""
    if message:
        flash.push(request, **message)
    return RedirectResponse(page, status_code=303)


@router.get("/account")
def account_page(request: Request, user: CurrentUser):
    return _account(request, user, **flash.pop(request))


@router.get("/account/keys", include_in_schema=False)
def account_keys_get(user: CurrentUser):
    """The key form's URL opened directly (reload, address bar): the account page."""
    return RedirectResponse("/account", status_code=303)


@router.get("/account/password", include_in_schema=False)
def account_password_get(user: CurrentUser):
    """The password form's URL opened directly: the account page."""
    return RedirectResponse("/account", status_code=303)


@router.post("/account/keys")
def account_key_create(request: Request, user: CurrentUser, name: Annotated[str, Form()] = ""):
    try:
        key, plain = accounts.create_api_key(_engine(request), user, name)
    except StudioError as exc:
        return _account(request, user, status_for(exc), key_error=exc.message)
    return _to("/account", request, new_key=plain, new_key_name=key.name)


@router.post("/account/keys/{key_id}/revoke")
def account_key_revoke(request: Request, user: CurrentUser, key_id: str):
    """Revoke one of the user's API keys (the page asks first, naming it); back to the account
    page with a notice (htmx: ``HX-Redirect``)."""
    key = accounts.revoke_api_key(_engine(request), user, key_id)
    if is_htmx(request):
        flash.push(request, key_notice=f"Revoked the key {key.name}.")
        return Response(status_code=200, headers={"HX-Redirect": "/account"})
    return _to("/account", request, key_notice=f"Revoked the key {key.name}.")


@router.post("/account/password")
def account_password(request: Request, user: CurrentUser,
                     current: Annotated[str, Form()] = "", password: Annotated[str, Form()] = ""):
    """Change one's own password (the current one is checked, rate-limited like a sign-in);
    every other session and access token of the user ends, API keys stay."""
    wait = _throttle(request, user.name)
    if wait:
        return _account(request, user, 429, _too_many(wait), password_error="too many attempts; "
                        f"try again in {_wait_s(wait)} s")
    try:
        accounts.authenticate(_engine(request), user.name, current)
    except StudioError:
        return _account(request, user, 422, password_error="the current password is wrong")
    _unthrottle(request, user.name)
    try:
        accounts.set_password(_engine(request), user, user.id, password,
                              keep_token=auth.current_token(request))
    except StudioError as exc:
        return _account(request, user, status_for(exc), password_error=exc.message)
    return _to("/account", request, password_ok=True)


# ---- admin page ----------------------------------------------------------------------------
AUDIT_PAGE = 50


def _int(value: str | None) -> int | None:
    return parse_id(value)


def _detail(detail: dict | None, names: dict[str, str]) -> list[tuple[str, str]]:
    """An event's detail as (key, text) pairs, user ids shown as user names."""
    out = []
    for k, v in (detail or {}).items():
        text = names.get(v, v) if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        out.append((k, text))
    return out


def _audit_view(request: Request, names: dict[str, str]) -> dict:
    """The audit card: events of the page the query asks for (filters ``user``, ``action``
    prefix; cursors ``before``/``after``), newest first, with names and page links."""
    q = request.query_params
    filters = {"user": q.get("user") or "", "action": (q.get("action") or "").strip()}
    page = audit.page(_engine(request), user=filters["user"] or None,
                      action_prefix=filters["action"] or None, before=_int(q.get("before")),
                      after=_int(q.get("after")), size=AUDIT_PAGE)
    kept = {k: v for k, v in filters.items() if v}

    def link(**cursor) -> str:
        return "/admin?" + urlencode({**kept, **cursor}) + "#audit"

    rows = [{"ts": e.ts, "who": names.get(e.user_id, e.user_id) if e.user_id else "—",
             "action": e.action,
             "object": (names.get(e.object_id, e.object_id) if e.object_type == "user"
                        else e.object_id) if e.object_id else "",
             "object_type": e.object_type or "", "detail": _detail(e.detail, names)}
            for e in page.events]
    return {"events": rows, "filters": filters, "anonymous": audit.ANONYMOUS,
            "older_url": link(before=page.older) if page.older else None,
            "newer_url": link(after=page.newer) if page.newer else None,
            "newest_url": link() if page.newer else None}


def _admin(request: Request, actor: User, status: int = 200, **extra) -> Response:
    engine = _engine(request)
    users = accounts.list_users(engine, actor)
    names = {u.id: u.name for u in users}
    locked = {u.id: why for u in users if (why := accounts.own_account_refusal(actor, u))}
    return render(request, "admin.html", {"user": actor, "users": users, "names": names,
                                          "locked": locked,
                                          **_audit_view(request, names), **extra},
                  status_code=status)


@router.get("/admin")
def admin_page(request: Request, actor: AdminUser):
    """Users, the add-user form and the audit log (filtered by user and action prefix, paged
    newest first)."""
    return _admin(request, actor, **flash.pop(request))


@router.get("/admin/users", include_in_schema=False)
def admin_users_get(actor: AdminUser):
    """The add-user form's URL opened directly: the admin page."""
    return RedirectResponse("/admin", status_code=303)


@router.get("/admin/users/{user_id}", include_in_schema=False)
def admin_user_get(actor: AdminUser, user_id: str):
    """A user-change form's URL opened directly: the admin page."""
    return RedirectResponse("/admin", status_code=303)


@router.post("/admin/users")
def admin_user_create(request: Request, actor: AdminUser, name: Annotated[str, Form()] = "",
                      password: Annotated[str, Form()] = "",
                      role: Annotated[str, Form()] = "member"):
    """Add a user. A refusal is POST-redirect-GET too (a reload does not post the form again):
    the admin page shows the typed name and role (never the password) and every field's error
    once."""
    try:
        created = accounts.create_user(_engine(request), name, password, role, actor=actor)
    except StudioError as exc:
        return _to("/admin#add-user", request, form={"name": name, "role": role},
                   errors=field_messages(exc))
    return _to("/admin", request, notice=f"Created {created.name}.")


@router.post("/admin/users/{user_id}")
def admin_user_change(request: Request, actor: AdminUser, user_id: str,
                      action: Annotated[str, Form()] = "", value: Annotated[str, Form()] = ""):
    """One change per form: ``action`` is password | role | disabled | custom_rewards."""
    engine = _engine(request)
    flag = value.lower() in ("1", "true", "on", "yes")
    try:
        if action == "password":
            target = accounts.set_password(engine, actor, user_id, value)
        elif action == "role":
            target = accounts.set_role(engine, actor, user_id, value)
        elif action == "disabled":
            target = accounts.set_disabled(engine, actor, user_id, flag)
        elif action == "custom_rewards":
            target = accounts.set_custom_rewards(engine, actor, user_id, flag)
        else:
            raise StudioError("invalid", "unknown change", "action")
    except StudioError as exc:
        if exc.kind == "not_found":
            raise
        return _admin(request, actor, status_for(exc), change_error=exc.message)
    done = _to("/admin", request, notice=f"Updated {target.name}.")
    if is_htmx(request):  # the confirmed Disable button: reload the admin page
        return Response(status_code=200, headers={"HX-Redirect": "/admin"})
    return done


# ---- JSON ----------------------------------------------------------------------------------
class TokenOut(BaseModel):
    """OAuth2 password-flow answer."""
    access_token: str
    token_type: Literal["bearer"] = "bearer"


class UserOut(BaseModel):
    """A user as the API shows it (never the password hash)."""
    id: str
    name: str
    role: str
    disabled: bool
    can_run_custom_rewards: bool
    created_at: float
    last_seen_at: float | None = None


class UserIn(BaseModel):
    """``POST /api/users`` body."""
    name: str
    password: str
    role: str = "member"


class KeyIn(BaseModel):
    """``POST /api/keys`` body."""
    name: str = "API key"


class KeyOut(BaseModel):
    """An API key without its secret."""
    id: str
    name: str
    prefix: str
    created_at: float
    last_used_at: float | None = None


class KeyCreated(BaseModel):
    """A new API key; ``key`` is shown this once."""
    id: str
    key: str
    name: str
    prefix: str


def _user_out(u: User) -> UserOut:
    return UserOut.model_validate(u, from_attributes=True)


def _key_out(k: ApiKey) -> KeyOut:
    return KeyOut.model_validate(k, from_attributes=True)


@router.post("/api/login/access-token", response_model=TokenOut)
def api_access_token(request: Request, form: Annotated[OAuth2PasswordRequestForm, Depends()]):
    wait = _throttle(request, form.username)
    if wait:
        resp = error_response(request, 429, "too many sign-in attempts; try again in "
                              f"{_wait_s(wait)} s", code="too_many")
        resp.headers.update(_too_many(wait))
        return resp
    user = accounts.authenticate(_engine(request), form.username, form.password)
    _unthrottle(request, form.username)
    token, _ = accounts.new_token(_engine(request), user, "access",
                                  request.app.state.settings.session_hours)
    return TokenOut(access_token=token)


@router.get("/api/me", response_model=UserOut)
def api_me(user: CurrentUser):
    return _user_out(user)


@router.get("/api/users", response_model=list[UserOut])
def api_users(request: Request, actor: AdminUser):
    return [_user_out(u) for u in accounts.list_users(_engine(request), actor)]


@router.post("/api/users", response_model=UserOut, status_code=201)
def api_user_create(request: Request, actor: AdminUser, body: UserIn):
    return _user_out(accounts.create_user(_engine(request), body.name, body.password, body.role,
                                          actor=actor))


@router.get("/api/keys", response_model=list[KeyOut])
def api_keys(request: Request, user: CurrentUser):
    return [_key_out(k) for k in accounts.list_api_keys(_engine(request), user)]


@router.post("/api/keys", response_model=KeyCreated, status_code=201)
def api_key_create(request: Request, user: CurrentUser, body: KeyIn):
    key, plain = accounts.create_api_key(_engine(request), user, body.name)
    return KeyCreated(id=key.id, key=plain, name=key.name, prefix=key.prefix)


@router.delete("/api/keys/{key_id}", status_code=204)
def api_key_revoke(request: Request, user: CurrentUser, key_id: str):
    accounts.revoke_api_key(_engine(request), user, key_id)
    return Response(status_code=204)


@router.post("/account/webhook")
def account_webhook(request: Request, user: CurrentUser,
                    webhook_url: Annotated[str, Form()] = ""):
    """Set or clear one's webhook URL (where run ends are POSTed as signed JSON); a new
    signing secret is shown once on the page the form returns to."""
    from app.studio import notify

    try:
        _, secret = notify.set_webhook(_engine(request), user, webhook_url,
                                       request.app.state.settings.webhook_allow_private)
    except StudioError as exc:
        return _account(request, user, status_for(exc), webhook_error=exc.message,
                        webhook_value=webhook_url)
    return _to("/account", request, webhook_ok=True, webhook_secret=secret)


class WebhookIn(BaseModel):
    """``PUT /api/me/webhook`` body: ``webhook_url``, required (empty or null clears it); any
    other field is a 422, so a misspelt body cannot clear a saved webhook."""
    model_config = ConfigDict(extra="forbid")
    webhook_url: str | None


class WebhookOut(BaseModel):
    """The caller's webhook; ``secret`` (``whsec_...``, Standard Webhooks) only in the answer
    that set it, shown this once."""
    webhook_url: str | None
    signed: bool
    secret: str | None = None


@router.get("/api/me/webhook", response_model=WebhookOut)
def api_webhook(user: CurrentUser):
    """The caller's webhook URL and whether its deliveries are signed (never the secret)."""
    return WebhookOut(webhook_url=user.webhook_url, signed=bool(user.webhook_secret))


@router.put("/api/me/webhook", response_model=WebhookOut)
def api_webhook_set(request: Request, user: CurrentUser, body: WebhookIn):
    """Set (or clear) the caller's webhook URL (422 naming ``webhook_url`` when it is not an
    absolute http(s) URL of a public host); answers it with its new signing secret."""
    from app.studio import notify

    saved, secret = notify.set_webhook(_engine(request), user, body.webhook_url,
                                       request.app.state.settings.webhook_allow_private)
    return WebhookOut(webhook_url=saved.webhook_url, signed=secret is not None, secret=secret)
