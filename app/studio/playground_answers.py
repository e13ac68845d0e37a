"""A playground prompt once sent (:func:`app.studio.playground.send_prompt`): stopping its
answer (a ``cancel`` event the worker reads between tokens), abandoning it when its ``/v1``
caller went away, and reading its answer's events as they come. Functions of a session already
checked (its job id), so they need no caller and no session lookup."""
from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store import events, queue
from app.store.db import session_scope
from app.store.schema import JobEvent, JobState
from app.studio.errors import StudioError


def cancel_prompt(engine: Engine, job_id: int, request_id: str) -> dict:
    """:func:`stop_prompt` for a session already checked (the web's own request, e.g. a
    ``/v1`` caller that went away). Raises StudioError not_found for an unknown ``request_id``."""
    with session_scope(engine, immediate=True) as s:
        rows = s.exec(select(JobEvent.type, JobEvent.data).where(
            JobEvent.job_id == job_id, JobEvent.type.in_(["prompt", "answer", "cancel"]))).all()
        mine = [(t, d) for t, d in rows if (d or {}).get("request_id") == request_id]
        if not any(t == "prompt" for t, _ in mine):
            raise StudioError("not_found", f"session {job_id} has no prompt {request_id!r}",
                              "request_id")
        prompt = next(d for t, d in mine if t == "prompt")
        sides = set((prompt.get("messages") or {}).keys())
        done = {d.get("side") for t, d in mine if t == "answer"} >= sides
        stopped = not done and not any(t == "cancel" for t, _ in mine)
        if stopped:
            events.append(s, job_id, "cancel", {"request_id": request_id})
    return {"request_id": request_id, "session": job_id, "stopped": stopped}


def abandon_prompt(engine: Engine, job_id: int, request_id: str) -> bool:
    """:func:`cancel_prompt` for a caller who went away (a ``/v1`` request that disconnected),
    and a session still waiting in the queue leaves it when no other prompt waits on it: nobody
    would read its answers, yet once admitted it would load the model and hold a slot. A
    running session stays (its model loaded for the caller's retry). Returns True when the
    session left the queue. Raises StudioError not_found for an unknown ``request_id``."""
    cancel_prompt(engine, job_id, request_id)
    with session_scope(engine) as s:
        rows = s.exec(select(JobEvent.type, JobEvent.data).where(
            JobEvent.job_id == job_id, JobEvent.type.in_(["prompt", "answer", "cancel"]))).all()
    ended = {(d or {}).get("request_id") for t, d in rows if t in ("answer", "cancel")}
    waiting = [d for t, d in rows if t == "prompt" and (d or {}).get("request_id") not in ended]
    return not waiting and queue.cancel_if_queued(engine, job_id)


def poll_answer(engine: Engine, job_id: int, request_id: str, side: str, after: int
                ) -> tuple[list[str], dict[str, Any] | None, int, str | None]:
    """One read of a prompt's progress on ``side``: ``(new text pieces, the answer event's
    data or None, the newest event id read, the job's final state when it ended without
    answering)``. Blocking (run it in a thread)."""
    pieces, answer = [], None
    batch = events.since(engine, job_id, after, 500, types=["token", "answer"])
    for ev in batch:
        after = ev.id
        d = ev.data or {}
        if d.get("request_id") != request_id or d.get("side") != side:
            continue
        if ev.type == "token":
            pieces.append(d.get("text") or "")
        else:
            answer = d
            break
    ended = None
    if answer is None and not batch:
        job = queue.get_job(engine, job_id)
        if job.state in JobState.FINAL:
            # the answer may have been written just before the end: read once more
            if not events.since(engine, job_id, after, 1, types=["token", "answer"]):
                ended = job.state
    return pieces, answer, after, ended
