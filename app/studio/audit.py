"""The audit log: who created, changed, cancelled, deleted, exported or downloaded what, and when.

Actions are dotted names such as ``user.created``, ``key.revoked``, ``login.failed``,
``run.cancelled``; ``detail`` is a small JSON object (never a secret).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store.db import session_scope
from app.store.schema import AuditEvent

ANONYMOUS = "anonymous"  # the ``user`` filter value for events without an actor


def record(engine: Engine, actor_id: str | None, action: str, object_type: str | None = None,
           object_id: str | None = None, **detail: Any) -> AuditEvent:
    """Append one audit event and return it.

    Args:
        actor_id: the acting user's id (None for anonymous, e.g. a failed sign-in).
        action: dotted name, e.g. ``"key.created"``.
        object_type, object_id: what it was done to (``"user"``, ``"user-3f9a..."``).
        detail: JSON-serialisable extras stored in ``detail`` (empty -> NULL).
    """
    ev = AuditEvent(user_id=actor_id, action=action, object_type=object_type,
                    object_id=None if object_id is None else str(object_id),
                    detail=dict(detail) or None)
    with session_scope(engine, immediate=True) as s:
        s.add(ev)
        s.flush()
        return ev


def recent(engine: Engine, limit: int = 100, *, user_id: str | None = None) -> list[AuditEvent]:
    """The newest ``limit`` events, newest first (only ``user_id``'s when given)."""
    q = select(AuditEvent)
    if user_id is not None:
        q = q.where(AuditEvent.user_id == user_id)
    with session_scope(engine) as s:
        return list(s.exec(q.order_by(AuditEvent.id.desc()).limit(max(1, int(limit)))).all())


@dataclass
class Page:
    """One page of the audit log, newest first: ``older``/``newer`` are the cursors (event ids)
    of the next older / newer page under the same filters, None when there is none."""

    events: list[AuditEvent]
    older: int | None
    newer: int | None


def _filtered(q, user: str | None, action_prefix: str | None):
    if user == ANONYMOUS:
        q = q.where(AuditEvent.user_id.is_(None))
    elif user:
        q = q.where(AuditEvent.user_id == user)
    if action_prefix:
        q = q.where(AuditEvent.action.startswith(action_prefix, autoescape=True))
    return q


def page(engine: Engine, *, user: str | None = None, action_prefix: str | None = None,
         before: int | None = None, after: int | None = None, size: int = 50) -> Page:
    """A page of ``size`` events, newest first: those older than event id ``before``, else those
    just newer than ``after``, else the newest.

    Args:
        user: only this user id's events (``ANONYMOUS``: only those without an actor).
        action_prefix: only actions starting with it (``"login."``, ``"run"``), taken literally.
    """
    size = max(1, int(size))
    with session_scope(engine) as s:
        q = _filtered(select(AuditEvent), user, action_prefix)
        if after is not None and before is None:
            rows = list(s.exec(q.where(AuditEvent.id > after).order_by(AuditEvent.id.asc())
                               .limit(size)).all())[::-1]
        else:
            if before is not None:
                q = q.where(AuditEvent.id < before)
            rows = list(s.exec(q.order_by(AuditEvent.id.desc()).limit(size)).all())
        if not rows:
            return Page([], None, None)
        ids = _filtered(select(AuditEvent.id), user, action_prefix)
        has_older = s.exec(ids.where(AuditEvent.id < rows[-1].id).limit(1)).first() is not None
        has_newer = s.exec(ids.where(AuditEvent.id > rows[0].id).limit(1)).first() is not None
    return Page(rows, rows[-1].id if has_older else None, rows[0].id if has_newer else None)
