"""The first start: the one-time ``/setup`` link that creates the first admin, the admin that
``WHETSTONE_ADMIN_PASSWORD`` creates or resets, and handing objects from before accounts existed
(owner NULL) to that first admin. HTTP-free; refusals are StudioErrors."""
from __future__ import annotations

import secrets

from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import delete, update
from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store.db import session_scope
from app.store.schema import AuthToken, Dataset, Job, Model, Run, User, now
from app.studio import audit
from app.studio.accounts import (_check_name, _check_password, _hasher, _sha, _update_user,
                                 check_new_account, create_user, has_users)
from app.studio.errors import StudioError

SETUP_HOURS = 24 * 7
_SETUP = "setup"  # AuthToken.kind of the one-time setup token (user_id empty)


def ensure_admin(engine: Engine, name: str, password: str) -> User:
    """Create admin ``name`` with ``password``, or reset that user's password, make it an
    enabled admin (used for ``WHETSTONE_ADMIN_PASSWORD``). Claims unowned objects when it is
    the first user. Raises StudioError invalid for a bad name or password."""
    name = _check_name(name)
    with session_scope(engine) as s:
        user = s.exec(select(User).where(User.name == name)).first()
    if user is None:
        first = not has_users(engine)
        user = create_user(engine, name, password, "admin")
        if first:
            claim_unowned(engine, user.id)
        return user
    if user.role == "admin" and not user.disabled:
        try:
            _hasher.verify(user.password_hash, password)
            return user  # unchanged: leave sessions alone
        except (VerificationError, InvalidHashError):
            pass
    _check_password(password)
    user = _update_user(engine, user.id, password_hash=_hasher.hash(password), role="admin",
                        disabled=False)
    audit.record(engine, None, "user.changed", "user", user.id, reset_by="WHETSTONE_ADMIN_PASSWORD")
    return user


def claim_unowned(engine: Engine, admin_id: str) -> dict[str, int]:
    """Give every dataset, run, job and non-shared model whose owner is NULL to ``admin_id``
    (an existing single-user data dir keeps all its work). Returns rows changed per table."""
    counts = {}
    with session_scope(engine, immediate=True) as s:
        for table in (Dataset, Run, Job):
            res = s.exec(update(table).where(table.owner.is_(None)).values(owner=admin_id))
            counts[table.__tablename__] = res.rowcount
        res = s.exec(update(Model).where(Model.owner.is_(None), Model.shared == False)  # noqa: E712
                     .values(owner=admin_id))
        counts["models"] = res.rowcount
    audit.record(engine, admin_id, "objects.claimed", "user", admin_id, **counts)
    return counts



def setup_token(engine: Engine) -> str:
    """A new one-time token for ``/setup`` (valid a week; any older one stops working).

    Raises StudioError conflict when users already exist."""
    if has_users(engine):
        raise StudioError("conflict", "the studio is already set up")
    token = secrets.token_urlsafe(32)
    with session_scope(engine, immediate=True) as s:
        s.exec(delete(AuthToken).where(AuthToken.kind == _SETUP))
        s.add(AuthToken(token_hash=_sha(token), user_id="", kind=_SETUP,
                        expires_at=now() + SETUP_HOURS * 3600))
    return token


def setup_token_valid(engine: Engine, token: str) -> bool:
    """Whether ``token`` is the current, unexpired setup token and no user exists yet."""
    with session_scope(engine) as s:
        row = s.exec(select(AuthToken).where(AuthToken.token_hash == _sha(token or ""),
                                             AuthToken.kind == _SETUP)).first()
    return row is not None and row.expires_at > now() and not has_users(engine)


def complete_setup(engine: Engine, token: str, name: str, password: str,
                   password2: str | None = None) -> User:
    """Create the first admin with the one-time ``token`` and give it every unowned object.

    Raises:
        StudioError: not_found (users exist already, or the token is wrong or used),
            invalid (:class:`~app.studio.errors.FieldErrors`: every bad field of ``name``,
            ``password`` and its repetition ``password2`` (when given) at once).
    """
    check_new_account(name, password, password2)
    if not setup_token_valid(engine, token):
        raise StudioError("not_found", "this setup link is not valid (already used or expired)")
    with session_scope(engine, immediate=True) as s:  # the token is spent exactly once
        spent = s.exec(delete(AuthToken).where(AuthToken.token_hash == _sha(token),
                                               AuthToken.kind == _SETUP)).rowcount
    if spent != 1 or has_users(engine):
        raise StudioError("not_found", "this setup link is not valid (already used or expired)")
    user = create_user(engine, name, password, "admin")
    claim_unowned(engine, user.id)
    return user
