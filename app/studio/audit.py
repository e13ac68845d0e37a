"""The audit log: who created, changed, cancelled, deleted, exported or downloaded what, and when.

Actions are dotted names such as ``user.created``, ``key.revoked``, ``login.failed``,
``run.cancelled``; ``detail`` is a small JSON object (never a secret).
"""
from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store.db import session_scope
from app.store.schema import AuditEvent


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
