"""The job queue: every SQL statement that changes a job's state lives here.

Protocol (DESIGN.md, "The queue protocol"):

* **claim** is one ``UPDATE ... WHERE id = (SELECT ... LIMIT 1) RETURNING id`` inside
  ``BEGIN IMMEDIATE`` on SQLite (``FOR UPDATE SKIP LOCKED`` on Postgres), so two workers can
  never claim the same job;
* **heartbeat**, **finish**, **fail** and **acknowledge_cancel** are fenced by
  ``lease_owner = me AND state = 'running'``: zero rows means the lease was lost and the
  worker must stop writing for that job;
* **reap** sends running jobs whose lease expired back to ``queued`` while attempts remain,
  else to ``failed`` with the reason.

Every state change appends a ``state`` event in the same transaction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import or_, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from app.store import events
from app.store.db import is_sqlite, session_scope
from app.store.schema import Job, JobState, now


class JobNotFound(LookupError):
    """Raised when a job id does not exist."""


@dataclass(frozen=True)
class Heartbeat:
    """Result of :func:`heartbeat`: ``alive`` False means the lease is lost."""

    alive: bool
    cancel_requested: bool


def _state_event(session: Session, job_id: int, state: str, **extra: Any) -> None:
    events.append(session, job_id, "state", {"state": state, **extra})


def enqueue(
    engine: Engine,
    kind: str,
    payload: dict[str, Any],
    *,
    priority: int = 0,
    max_attempts: int = 3,
    run_id: str | None = None,
    owner: str | None = None,
) -> Job:
    """Insert a queued job and return it (with its id).

    Args:
        kind: ``train`` | ``grpo`` | ``export`` | ``import_model``.
        payload: JSON-serialisable job input (a versioned spec from ``app.store.specs``).
        priority: higher runs first; ties run in id order.
        max_attempts: claims allowed before a job whose lease keeps expiring is failed.
    """
    with session_scope(engine, immediate=True) as s:
        job = Job(kind=kind, payload=payload, priority=priority, max_attempts=max_attempts,
                  run_id=run_id, owner=owner)
        s.add(job)
        s.flush()
        _state_event(s, job.id, JobState.QUEUED)
        return job


def claim(engine: Engine, worker_id: str, lease_seconds: float,
          kinds: list[str] | None = None) -> Job | None:
    """Atomically claim the highest-priority queued job, or return None when there is none.

    The job becomes ``running`` with ``lease_owner = worker_id`` and a lease of
    ``lease_seconds`` seconds; ``attempts`` is incremented.
    """
    kind_sql = ""
    params: dict[str, Any] = {"w": worker_id, "now": now()}
    params["exp"] = params["now"] + lease_seconds
    if kinds:
        names = [f":k{i}" for i in range(len(kinds))]
        kind_sql = f" AND kind IN ({', '.join(names)})"
        params.update({f"k{i}": k for i, k in enumerate(kinds)})
    lock = "" if is_sqlite(engine) else " FOR UPDATE SKIP LOCKED"
    sql = text(
        "UPDATE jobs SET state = 'running', lease_owner = :w, lease_expires_at = :exp, "
        "attempts = attempts + 1, started_at = COALESCE(started_at, :now) "
        "WHERE id = (SELECT id FROM jobs WHERE state = 'queued' AND cancel_requested = :f"
        f"{kind_sql} ORDER BY priority DESC, id LIMIT 1{lock}) AND state = 'queued' "
        "RETURNING id"
    )
    params["f"] = False
    with session_scope(engine, immediate=True) as s:
        row = s.execute(sql, params).first()
        if row is None:
            return None
        job = s.get(Job, row[0])
        s.refresh(job)
        _state_event(s, job.id, JobState.RUNNING, worker=worker_id, attempt=job.attempts)
        return job


def heartbeat(engine: Engine, job_id: int, worker_id: str, lease_seconds: float) -> Heartbeat:
    """Extend the lease of a job this worker holds; report whether cancel was requested."""
    with session_scope(engine, immediate=True) as s:
        row = s.execute(
            text("UPDATE jobs SET lease_expires_at = :exp WHERE id = :id AND lease_owner = :w "
                 "AND state = 'running' RETURNING cancel_requested"),
            {"exp": now() + lease_seconds, "id": job_id, "w": worker_id},
        ).first()
    if row is None:
        return Heartbeat(alive=False, cancel_requested=False)
    return Heartbeat(alive=True, cancel_requested=bool(row[0]))


def _fenced_end(engine: Engine, job_id: int, worker_id: str, state: str,
                error: str | None = None, result: dict[str, Any] | None = None,
                extra_sets: str = "") -> bool:
    with session_scope(engine, immediate=True) as s:
        row = s.execute(
            text(f"UPDATE jobs SET state = :st, finished_at = :now, lease_expires_at = NULL{extra_sets} "
                 "WHERE id = :id AND lease_owner = :w AND state = 'running' RETURNING id"),
            {"st": state, "now": now(), "id": job_id, "w": worker_id},
        ).first()
        if row is None:
            return False
        job = s.get(Job, job_id)
        if error is not None:
            job.error = error
        if result is not None:
            job.result = result
        s.add(job)
        _state_event(s, job_id, state, **({"error": error} if error else {}))
        return True


def finish(engine: Engine, job_id: int, worker_id: str, result: dict[str, Any] | None = None) -> bool:
    """Mark a held job succeeded with ``result``; False if the lease was lost."""
    return _fenced_end(engine, job_id, worker_id, JobState.SUCCEEDED, result=result)


def fail(engine: Engine, job_id: int, worker_id: str, error: str) -> bool:
    """Mark a held job failed with the message ``error``; False if the lease was lost."""
    return _fenced_end(engine, job_id, worker_id, JobState.FAILED, error=error)


def acknowledge_cancel(engine: Engine, job_id: int, worker_id: str) -> bool:
    """The worker stopped a job whose cancel flag it saw: mark it cancelled."""
    return _fenced_end(engine, job_id, worker_id, JobState.CANCELLED)


def release(engine: Engine, job_id: int, worker_id: str, reason: str) -> bool:
    """Give a held job back to the queue (worker shutting down); the attempt is not counted."""
    with session_scope(engine, immediate=True) as s:
        row = s.execute(
            text("UPDATE jobs SET state = 'queued', lease_owner = NULL, lease_expires_at = NULL, "
                 "attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END "
                 "WHERE id = :id AND lease_owner = :w AND state = 'running' RETURNING id"),
            {"id": job_id, "w": worker_id},
        ).first()
        if row is None:
            return False
        _state_event(s, job_id, JobState.QUEUED, reason=reason)
        return True


def cancel(engine: Engine, job_id: int) -> Job:
    """Cancel a job: a queued job ends at once, a running one gets its cancel flag set.

    Raises:
        JobNotFound: no job has this id.
    """
    with session_scope(engine, immediate=True) as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(job_id)
        if job.state == JobState.QUEUED:
            job.state = JobState.CANCELLED
            job.cancel_requested = True
            job.finished_at = now()
            _state_event(s, job_id, JobState.CANCELLED)
        elif job.state == JobState.RUNNING and not job.cancel_requested:
            job.cancel_requested = True
            events.append(s, job_id, "log", {"level": "info", "message": "cancel requested"})
        s.add(job)
        s.flush()
        return job


def reap(engine: Engine, restarted: str | None = None) -> list[tuple[int, str]]:
    """Requeue (attempts left) or fail (none left) running jobs whose lease expired, and, with
    ``restarted`` (a worker id that is starting up), every job still leased to that id: the
    process that held it is gone, so its job need not wait for the lease to run out. Worker ids
    must be unique among live workers (one per GPU slot, see docker/start.sh).

    Returns:
        ``[(job_id, new_state), ...]`` for every job reaped.
    """
    t = now()
    out: list[tuple[int, str]] = []
    with session_scope(engine, immediate=True) as s:
        gone = Job.lease_expires_at < t
        if restarted is not None:
            gone = or_(gone, Job.lease_owner == restarted)
        expired = s.exec(select(Job).where(Job.state == JobState.RUNNING, gone)).all()
        for job in expired:
            owner = job.lease_owner
            if job.cancel_requested:
                job.state, reason = JobState.CANCELLED, "cancelled; its worker stopped answering"
            elif job.attempts < job.max_attempts:
                job.state, reason = JobState.QUEUED, (
                    f"worker {owner} restarted; requeued" if owner == restarted
                    else f"lease of worker {owner} expired; requeued")
            else:
                job.state = JobState.FAILED
                reason = (f"lease of worker {owner} expired after {job.attempts} attempts "
                          f"(max_attempts={job.max_attempts})")
                job.error = reason
            if job.state != JobState.QUEUED:
                job.finished_at = t
            job.lease_owner = None
            job.lease_expires_at = None
            s.add(job)
            _state_event(s, job.id, job.state, reason=reason)
            out.append((job.id, job.state))
    return out


def get_job(engine: Engine, job_id: int) -> Job:
    """Load one job. Raises :class:`JobNotFound`."""
    with session_scope(engine) as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job


def list_jobs(engine: Engine, state: str | None = None, limit: int = 100) -> list[Job]:
    """Jobs, newest first, optionally of one state."""
    with session_scope(engine) as s:
        q = select(Job).order_by(Job.id.desc()).limit(limit)
        if state:
            q = q.where(Job.state == state)
        return list(s.exec(q).all())
