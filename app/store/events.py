"""Append-only job events (state, metric, log, progress, sample) and reads "since id".

The SSE endpoint streams rows with ``id > Last-Event-ID``, so a reconnecting browser misses
nothing. Writers batch: :func:`append_many` writes several events in one transaction.

Event ``data`` by type:

* ``state``: ``{"state": str, "error"?: str, "reason"?: str}``
* ``metric``: ``{"step": int, "total_steps": int, "loss": float, "learning_rate": float,
  "grad_norm": float, "tokens_per_second": float, "eta_seconds": float,
  "memory_gib": float, "memory_kind": "gpu"|"rss", "epoch": float}`` (keys optional but step)
* ``log``: ``{"level": "info"|"warning"|"error", "message": str}``
* ``progress``: ``{"stage": str, "done": int|float, "total": int|float, "message"?: str}``
"""
from __future__ import annotations

import re
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from app.store.db import session_scope
from app.store.schema import JobEvent, now

#: The largest row id SQLite (and a Postgres BIGINT) can hold; a larger cursor matches no row.
MAX_ID = 2**63 - 1


def parse_id(value: Any) -> int | None:
    """A row-id cursor (``Last-Event-ID``, ``?after=``, ``?before=``) as an int, or None when
    it is not a non-negative decimal integer of at most :data:`MAX_ID` (text, surrounding
    blanks allowed). Such a value is never handed to the database, where it would overflow."""
    if isinstance(value, bool) or value is None:
        return None
    text = str(value).strip()
    if not re.fullmatch(r"[0-9]{1,19}", text):
        return None
    n = int(text)
    return n if n <= MAX_ID else None


def append(session: Session, job_id: int, type: str, data: dict[str, Any]) -> JobEvent:
    """Add one event inside the caller's transaction."""
    ev = JobEvent(job_id=job_id, type=type, data=data, ts=now())
    session.add(ev)
    return ev


def append_many(engine: Engine, job_id: int, items: list[tuple[str, dict[str, Any]]]) -> int:
    """Write ``[(type, data), ...]`` for one job in one transaction; returns how many."""
    if not items:
        return 0
    with session_scope(engine, immediate=True) as s:
        for type_, data in items:
            append(s, job_id, type_, data)
    return len(items)


def since(engine: Engine, job_id: int, after_id: int = 0, limit: int = 1000,
          types: list[str] | None = None) -> list[JobEvent]:
    """Events of ``job_id`` with ``id > after_id`` in id order, at most ``limit``."""
    with session_scope(engine) as s:
        q = (select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after_id)
             .order_by(JobEvent.id).limit(limit))
        if types:
            q = q.where(JobEvent.type.in_(types))
        return list(s.exec(q).all())


def recent(engine: Engine, job_id: int, type: str, limit: int = 10) -> list[JobEvent]:
    """The newest ``limit`` events of one type for a job, newest first."""
    with session_scope(engine) as s:
        q = (select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == type)
             .order_by(JobEvent.id.desc()).limit(limit))
        return list(s.exec(q).all())


def newest_id(engine: Engine, job_id: int) -> int:
    """The id of ``job_id``'s newest event, 0 when it has none."""
    with session_scope(engine) as s:
        q = (select(JobEvent.id).where(JobEvent.job_id == job_id)
             .order_by(JobEvent.id.desc()).limit(1))
        return s.exec(q).first() or 0


def latest(engine: Engine, job_id: int, type: str) -> JobEvent | None:
    """The newest event of one type for a job, or None."""
    with session_scope(engine) as s:
        q = (select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == type)
             .order_by(JobEvent.id.desc()).limit(1))
        return s.exec(q).first()
