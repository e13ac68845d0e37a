"""Accounts: users, passwords (argon2), API keys and sign-in tokens (the first start, setup link
and ``WHETSTONE_ADMIN_PASSWORD``, is :mod:`app.studio.first_start`).

HTTP-free: every refusal is a :class:`~app.studio.errors.StudioError`. Secrets (API keys,
session/access tokens, the setup token) are 32 random bytes, shown once and stored only as
their sha256 (hex) — a fast hash is right for high-entropy secrets; passwords use argon2id.
"""
from __future__ import annotations

import hashlib
import re
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import delete, func, update
from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store.db import session_scope
from app.store.schema import ApiKey, AuthToken, User, now
from app.studio import audit
from app.studio.access import can_see, require_admin
from app.studio.errors import StudioError, collect, invalid, not_found

ROLES = ("admin", "member")
TOKEN_KINDS = ("session", "access")
KEY_PREFIX = "wk-"
#: What a disabled account's sign-in and API keys are told (code ``account_disabled``).
DISABLED = "this account is disabled; ask an admin"
MIN_PASSWORD = 8
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_BAD_LOGIN = "wrong user name or password"
_SEEN_EVERY = 60.0  # seconds between last_seen_at updates

_hasher = PasswordHasher()
_DUMMY_HASH = _hasher.hash("not a real password")  # equalises the time of unknown-user sign-ins


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _check_name(name: str) -> str:
    name = (name or "").strip()
    if not _NAME.match(name):
        raise invalid("name", "a user name is 1-64 letters, digits or . _ @ - and starts with a "
                              "letter or digit")
    return name


def _check_password(password: str) -> str:
    if len(password or "") < MIN_PASSWORD:
        raise invalid("password", f"the password needs at least {MIN_PASSWORD} characters")
    if len(password) > 1024:
        raise invalid("password", "the password is longer than 1024 characters")
    return password


def check_new_account(name: str, password: str, password2: str | None = None,
                      role: str | None = None) -> str:
    """The stripped ``name`` of a new account once every field passes: the name, the password,
    its repetition ``password2`` (when given) and the ``role`` (when given).

    Raises: :class:`~app.studio.errors.FieldErrors` (kind invalid) naming every bad field at
    once (``name``, ``password``, ``password2``, ``role``)."""
    def again() -> None:
        if password2 is not None and password != password2:
            raise invalid("password2", "the passwords differ")

    def role_ok() -> None:
        if role is not None and role not in ROLES:
            raise invalid("role", f"role must be one of {', '.join(ROLES)}")

    collect(lambda: _check_name(name), lambda: _check_password(password), again, role_ok)
    return name.strip()


def own_account_refusal(actor: User, target: User) -> str | None:
    """Why ``actor`` may not demote or disable ``target`` (their own admin account), for the
    Admin page to show in place of the buttons; None when they may."""
    if target.id == actor.id and target.role == "admin":
        return "you cannot demote or disable your own account"
    return None


# ---- users ---------------------------------------------------------------------------------
def has_users(engine: Engine) -> bool:
    """True once at least one user exists."""
    with session_scope(engine) as s:
        return s.exec(select(User.id).limit(1)).first() is not None


def get_user(engine: Engine, user_id: str) -> User:
    """The user with ``user_id``. Raises StudioError not_found."""
    with session_scope(engine) as s:
        user = s.get(User, user_id)
    if user is None:
        raise not_found("user", user_id)
    return user


def list_users(engine: Engine, actor: User) -> list[User]:
    """Every user by name (admin only; StudioError forbidden otherwise)."""
    require_admin(actor)
    with session_scope(engine) as s:
        return list(s.exec(select(User).order_by(User.name)).all())


def create_user(engine: Engine, name: str, password: str, role: str = "member", *,
                actor: User | None = None) -> User:
    """Create a user. ``actor`` None is only for bootstrap (setup, WHETSTONE_ADMIN_PASSWORD).

    Raises:
        StudioError: forbidden (actor not an admin), invalid (every bad field of ``name``,
            ``password`` and ``role`` at once, :func:`check_new_account`), conflict (the name
            is taken).
    """
    if actor is not None:
        require_admin(actor)
    name = check_new_account(name, password, role=role)
    user = User(name=name, password_hash=_hasher.hash(password), role=role)
    with session_scope(engine, immediate=True) as s:
        taken = s.exec(select(User.name).where(func.lower(User.name) == name.lower())).first()
        if taken is not None:  # names are unique regardless of case: say which one holds it
            same = "" if taken == name else f" (names ignore case: {name!r} is {taken!r})"
            raise StudioError("conflict", f"a user named {taken!r} already exists{same}", "name")
        s.add(user)
    audit.record(engine, actor.id if actor else None, "user.created", "user", user.id,
                 name=name, role=role)
    return user


def authenticate(engine: Engine, name: str, password: str) -> User:
    """The user ``name`` (in any case: names are unique ignoring case) if ``password`` is
    theirs; records ``login.succeeded``/``login.failed``.

    Raises:
        StudioError: unauthorized, with one message for an unknown user and a wrong password
            alike; a disabled account is refused with its own message (after the password check).
    """
    name = (name or "").strip()
    with session_scope(engine) as s:
        user = s.exec(select(User).where(func.lower(User.name) == name.lower())).first()
    try:
        _hasher.verify(user.password_hash if user else _DUMMY_HASH, password or "")
        ok = user is not None
    except (VerificationError, InvalidHashError):
        ok = False
    if not ok:
        audit.record(engine, user.id if user else None, "login.failed", "user",
                     user.id if user else None, name=name[:64])
        raise StudioError("unauthorized", _BAD_LOGIN)
    if user.disabled:
        audit.record(engine, user.id, "login.failed", "user", user.id, reason="disabled")
        raise StudioError("unauthorized", DISABLED, code="account_disabled")
    if _hasher.check_needs_rehash(user.password_hash):
        _update_user(engine, user.id, password_hash=_hasher.hash(password))
    audit.record(engine, user.id, "login.succeeded", "user", user.id)
    return user


def _update_user(engine: Engine, user_id: str, **fields) -> User:
    with session_scope(engine, immediate=True) as s:
        user = s.get(User, user_id)
        if user is None:
            raise not_found("user", user_id)
        for k, v in fields.items():
            setattr(user, k, v)
        s.add(user)
        return user


def _end_all_tokens(engine: Engine, user_id: str, keep: str | None = None) -> int:
    """Delete ``user_id``'s sessions and access tokens but the one whose plaintext is ``keep``;
    returns how many ended."""
    q = delete(AuthToken).where(AuthToken.user_id == user_id)
    if keep:
        q = q.where(AuthToken.token_hash != _sha(keep))
    with session_scope(engine, immediate=True) as s:
        return s.exec(q).rowcount


def set_password(engine: Engine, actor: User, user_id: str, password: str, *,
                 keep_token: str | None = None) -> User:
    """Set ``user_id``'s password: the user themself or an admin. Every session and access token
    of that user ends, except ``keep_token`` (the caller's own sign-in, when they change their
    own password); API keys are separate credentials and stay valid.

    Raises:
        StudioError: not_found (no such user, or another's account for a member), invalid
            (field ``password``).
    """
    if actor.id != user_id and actor.role != "admin":
        raise not_found("user", user_id)
    _check_password(password)
    user = _update_user(engine, user_id, password_hash=_hasher.hash(password))
    ended = _end_all_tokens(engine, user_id, keep_token if actor.id == user_id else None)
    audit.record(engine, actor.id, "user.password_changed", "user", user_id,
                 sign_ins_ended=ended)
    return user


def _admin_change(engine: Engine, actor: User, user_id: str, **fields) -> User:
    require_admin(actor)
    target = get_user(engine, user_id)
    losing_admin = target.role == "admin" and (fields.get("role", "admin") != "admin"
                                               or fields.get("disabled"))
    if losing_admin:
        refusal = own_account_refusal(actor, target)
        if refusal:
            raise StudioError("conflict", refusal)
        with session_scope(engine) as s:
            admins = s.exec(select(func.count()).select_from(User).where(
                User.role == "admin", User.disabled == False)).one()  # noqa: E712
        if admins <= 1:
            raise StudioError("conflict", "this is the last active admin")
    user = _update_user(engine, user_id, **fields)
    if target.disabled and fields.get("disabled") is False:
        # Re-enabled: the sign-ins made before it was disabled stay ended. While it was disabled
        # they were refused (session_for_token) but kept, so that a refused call says why.
        _end_all_tokens(engine, user_id)
    audit.record(engine, actor.id, "user.changed", "user", user_id, **fields)
    return user


def set_role(engine: Engine, actor: User, user_id: str, role: str) -> User:
    """Make ``user_id`` an ``admin`` or a ``member`` (admin only; the last admin stays one).

    Raises: StudioError forbidden, not_found, invalid (field ``role``), conflict."""
    if role not in ROLES:
        raise invalid("role", f"role must be one of {', '.join(ROLES)}")
    return _admin_change(engine, actor, user_id, role=role)


def set_disabled(engine: Engine, actor: User, user_id: str, disabled: bool) -> User:
    """Disable (every sign-in and API key refused at once, told :data:`DISABLED`) or re-enable
    ``user_id`` (admin only; the sign-ins made before it was disabled do not come back, its
    unrevoked API keys do).

    Raises: StudioError forbidden, not_found, conflict (own account or the last admin)."""
    return _admin_change(engine, actor, user_id, disabled=bool(disabled))


def set_custom_rewards(engine: Engine, actor: User, user_id: str, allowed: bool) -> User:
    """Allow or forbid ``user_id`` to run custom Python reward code in GRPO runs (admin only).

    Raises: StudioError forbidden, not_found."""
    return _admin_change(engine, actor, user_id, can_run_custom_rewards=bool(allowed))


# ---- API keys ------------------------------------------------------------------------------
def create_api_key(engine: Engine, user: User, name: str) -> tuple[ApiKey, str]:
    """A new key for ``user``: ``(row, plaintext)``; the plaintext ``wk-...`` is shown once.

    Raises StudioError invalid (field ``name``: 1-100 characters)."""
    name = (name or "").strip()
    if not name or len(name) > 100:
        raise invalid("name", "give the key a name of 1-100 characters")
    plain = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(user_id=user.id, name=name, prefix=plain[:8], key_hash=_sha(plain))
    with session_scope(engine, immediate=True) as s:
        s.add(key)
    audit.record(engine, user.id, "key.created", "api_key", key.id, name=name)
    return key, plain


def list_api_keys(engine: Engine, user: User) -> list[ApiKey]:
    """``user``'s keys that are not revoked, newest first."""
    with session_scope(engine) as s:
        return list(s.exec(select(ApiKey).where(ApiKey.user_id == user.id,
                                                ApiKey.revoked_at.is_(None))
                           .order_by(ApiKey.created_at.desc())).all())


def revoke_api_key(engine: Engine, actor: User, key_id: str) -> ApiKey:
    """Revoke a key of ``actor`` (an admin may revoke anyone's).

    Raises StudioError not_found for a missing, already revoked or another user's key."""
    with session_scope(engine, immediate=True) as s:
        key = s.get(ApiKey, key_id)
        if key is None or key.revoked_at is not None or not can_see(actor, key.user_id):
            raise not_found("API key", key_id)
        key.revoked_at = now()
        s.add(key)
    audit.record(engine, actor.id, "key.revoked", "api_key", key_id, owner=key.user_id)
    return key


def user_for_api_key(engine: Engine, key: str) -> User | None:
    """The enabled user owning the unrevoked API key ``key`` (its last_used_at is updated)."""
    if not key or not key.startswith(KEY_PREFIX):
        return None
    with session_scope(engine) as s:
        row = s.exec(select(ApiKey).where(ApiKey.key_hash == _sha(key))).first()
        if row is None or row.revoked_at is not None:
            return None
        user = s.get(User, row.user_id)
    if user is None or user.disabled:
        return None
    t = now()
    if row.last_used_at is None or t - row.last_used_at >= _SEEN_EVERY:
        with session_scope(engine, immediate=True) as s:
            s.exec(update(ApiKey).where(ApiKey.id == row.id).values(last_used_at=t))
    _touch(engine, user, t)
    return user


def disabled_owner(engine: Engine, key: str) -> bool:
    """Whether ``key`` (an API key, or a session or access token) is unrevoked and unexpired
    but its account is disabled: what a refused Bearer call is told instead of "invalid or
    revoked" (trials s24, s25: a disabled member's script could not tell a revoked key or an
    ended sign-in from a disabled account)."""
    if not key:
        return False
    with session_scope(engine) as s:
        if key.startswith(KEY_PREFIX):
            row = s.exec(select(ApiKey).where(ApiKey.key_hash == _sha(key))).first()
            live = row is not None and row.revoked_at is None
        else:
            row = s.exec(select(AuthToken).where(AuthToken.token_hash == _sha(key))).first()
            live = row is not None and row.kind in TOKEN_KINDS and row.expires_at > now()
        user = s.get(User, row.user_id) if live else None
    return user is not None and bool(user.disabled)


# ---- sessions and access tokens -------------------------------------------------------------
def new_token(engine: Engine, user: User, kind: str, hours: float) -> tuple[str, AuthToken]:
    """Start a ``session`` (browser cookie) or ``access`` (Bearer) sign-in lasting ``hours``.

    Returns ``(plaintext token, row)``; the row's ``csrf_token`` guards the session's forms.
    Raises ValueError for an unknown kind (a programming error)."""
    if kind not in TOKEN_KINDS:
        raise ValueError(f"unknown token kind {kind!r}")
    token = secrets.token_urlsafe(32)
    row = AuthToken(token_hash=_sha(token), user_id=user.id, kind=kind,
                    expires_at=now() + hours * 3600)
    with session_scope(engine, immediate=True) as s:
        s.exec(delete(AuthToken).where(AuthToken.expires_at <= now()))  # expired ones go
        s.add(row)
    return token, row


def session_for_token(engine: Engine, token: str) -> tuple[User, AuthToken] | None:
    """``(user, token row)`` for a live session/access token of an enabled user, else None."""
    if not token:
        return None
    with session_scope(engine) as s:
        row = s.exec(select(AuthToken).where(AuthToken.token_hash == _sha(token))).first()
        if row is None or row.kind not in TOKEN_KINDS or row.expires_at <= now():
            return None
        user = s.get(User, row.user_id)
    if user is None or user.disabled:
        return None
    _touch(engine, user, now())
    return user, row


def user_for_token(engine: Engine, token: str) -> User | None:
    """The user of a live session or access token (expiry and disabled checked), else None."""
    found = session_for_token(engine, token)
    return found[0] if found else None


def end_token(engine: Engine, token: str) -> None:
    """Sign out: delete the session or access token (nothing happens for an unknown one)."""
    if token:
        with session_scope(engine, immediate=True) as s:
            s.exec(delete(AuthToken).where(AuthToken.token_hash == _sha(token),
                                           AuthToken.kind.in_(TOKEN_KINDS)))


def list_sign_ins(engine: Engine, user: User, current: str | None = None
                  ) -> list[tuple[AuthToken, bool]]:
    """``user``'s live sign-ins (browser sessions and Bearer access tokens), newest first, each
    with True for the one whose plaintext is ``current`` (the caller's own). API keys are not
    sign-ins (:func:`list_api_keys`)."""
    mine = _sha(current) if current else None
    with session_scope(engine) as s:
        rows = s.exec(select(AuthToken).where(AuthToken.user_id == user.id,
                                              AuthToken.kind.in_(TOKEN_KINDS),
                                              AuthToken.expires_at > now())
                      .order_by(AuthToken.created_at.desc())).all()
    return [(r, r.token_hash == mine) for r in rows]


def sign_out_others(engine: Engine, user: User, keep_token: str | None) -> int:
    """Sign ``user`` out everywhere but here: every session and access token of theirs ends,
    except the one whose plaintext is ``keep_token`` (the caller's sign-in; None, as for an
    API-key caller, keeps none). API keys stay valid. Returns how many ended (audited)."""
    with session_scope(engine, immediate=True) as s:  # expired ones are no sign-ins to count
        s.exec(delete(AuthToken).where(AuthToken.user_id == user.id,
                                       AuthToken.expires_at <= now()))
    ended = _end_all_tokens(engine, user.id, keep_token)
    audit.record(engine, user.id, "user.signed_out_others", "user", user.id, sign_ins_ended=ended)
    return ended


def _touch(engine: Engine, user: User, t: float) -> None:
    if user.last_seen_at is None or t - user.last_seen_at >= _SEEN_EVERY:
        with session_scope(engine, immediate=True) as s:
            s.exec(update(User).where(User.id == user.id).values(last_seen_at=t))
        user.last_seen_at = t
