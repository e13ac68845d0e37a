"""The job queue: every SQL statement that changes a job's state lives here.

Protocol (DESIGN.md, "The queue protocol"):

* **claim** is one ``UPDATE ... WHERE id = (SELECT ... LIMIT 1) RETURNING id`` inside
  ``BEGIN IMMEDIATE`` on SQLite (``FOR UPDATE SKIP LOCKED`` on Postgres), so two workers can
  never claim the same job; its ``ORDER BY`` takes turns by owner (:data:`KIND_RANK`);
* **heartbeat**, **finish**, **fail** and **acknowledge_cancel** are fenced by
  ``lease_owner = me AND state = 'running'``: zero rows means the lease was lost and the
  worker must stop writing for that job;
* **reap** sends running jobs whose lease expired back to ``queued`` while attempts remain,
  else to ``failed`` with the reason (a killed worker process is named as such, with the
  memory it last recorded).

Every write transaction here is one or two short statements; none is held across work.

Every state change appends a ``state`` event in the same transaction.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from app.store import admission, events
from app.store.db import is_sqlite, session_scope
from app.store.schema import Job, JobEvent, JobState, now


#: Job kinds that need no GPU: a worker's CPU lane claims them, so they never wait behind a
#: training job (train, grpo), which its main lane runs.
CPU_KINDS = ("export", "import_model", "validate_dataset")

#: Claim order, decided here once (``claim``'s SQL and every page that shows a queue position use
#: it): a kind's rank first, then the owner's turn (below), then ``priority`` (higher first), then
#: age (id). Dataset validations rank first: one takes about a second to a few minutes and its
#: user waits at the upload page, while an export takes minutes (15 on a loaded 2-core box), so
#: uploads queued behind exports (priority 5) started 17 minutes late.
#:
#: Within a rank the lane takes turns by owner (``jobs.owner``; jobs without one are one owner):
#: the next job is one of the owner whose newest ``started_at`` among the lane's kinds is oldest
#: (never started: first). Each claim sets its job's ``started_at``, so a user who queues ten
#: exports gets every other turn, not the next ten (the trial: everyone else waited behind one
#: user's exports). :func:`claim_order` replays it for the pages.
KIND_RANK = {"validate_dataset": 0}
OTHER_RANK = 1


def claim_key(job: Job) -> tuple[int, int, int]:
    """The sort key of ``job`` by rank, priority and age alone (:data:`KIND_RANK`), before turns
    by owner (:func:`claim_order`); lower claims first."""
    return (KIND_RANK.get(job.kind, OTHER_RANK), -(job.priority or 0), job.id or 0)


def _rank_sql(col: str = "kind") -> str:
    whens = " ".join(f"WHEN '{k}' THEN {r}" for k, r in KIND_RANK.items())
    return f"CASE {col} {whens} ELSE {OTHER_RANK} END"


def last_turns(session: Session, kinds: Collection[str]) -> dict[str | None, float]:
    """owner -> newest ``started_at`` (epoch seconds) of a job of ``kinds`` (the owner's last
    turn); owners who never started one are absent."""
    rows = session.exec(select(Job.owner, func.max(Job.started_at))
                        .where(Job.kind.in_(list(kinds)), Job.started_at.is_not(None))
                        .group_by(Job.owner)).all()
    return {o: t for o, t in rows}


def claim_order(queued: list[Job], last: dict[str | None, float]) -> list[Job]:
    """``queued`` jobs of one lane in the order :func:`claim` takes them, given ``last``
    (:func:`last_turns`): each pick is the least key (rank, owner's last turn, -priority, id),
    then its owner's last turn becomes the newest."""
    last, left, out = dict(last), list(queued), []
    clock = max(last.values(), default=0.0)
    while left:
        job = min(left, key=lambda j: (claim_key(j)[0], last.get(j.owner, 0.0), *claim_key(j)[1:]))
        left.remove(job)
        out.append(job)
        clock += 1.0
        last[job.owner] = clock
    return out


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
    estimate_gib: float | None = None,
) -> Job:
    """Insert a queued job and return it (with its id).

    Args:
        kind: ``train`` | ``grpo`` | ``export`` | ``import_model``.
        payload: JSON-serialisable job input (a versioned spec from ``app.store.specs``).
        priority: higher runs first; ties run in id order.
        max_attempts: claims allowed before a job whose lease keeps expiring is failed.
        estimate_gib: the job's estimated GPU allocator peak in GiB (what admission packs by).
    """
    return enqueue_unless(engine, kind, payload, None, priority=priority,
                          max_attempts=max_attempts, run_id=run_id, owner=owner,
                          estimate_gib=estimate_gib)[0]


#: Postgres advisory lock :func:`enqueue_unless` takes when it looks for an existing job, so that
#: two callers cannot both find none and both insert (SQLite's BEGIN IMMEDIATE does the same).
ENQUEUE_LOCK = 0x57480016


def enqueue_unless(engine: Engine, kind: str, payload: dict[str, Any],
                   existing: Callable[[Session], Job | None] | None, **kw: Any
                   ) -> tuple[Job, bool]:
    """``(job, found)``: the job ``existing(session)`` finds (read under the write lock, so
    two concurrent calls cannot both miss it and insert twice), else a new queued job as
    :func:`enqueue` makes with ``kw``."""
    with session_scope(engine, immediate=True) as s:
        if existing is not None:
            if not is_sqlite(engine):
                s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ENQUEUE_LOCK})
            found = existing(s)
            if found is not None:
                return found, True
        job = Job(kind=kind, payload=payload, **kw)
        s.add(job)
        s.flush()
        _state_event(s, job.id, JobState.QUEUED)
        return job, False


def claim(engine: Engine, worker_id: str, lease_seconds: float,
          kinds: list[str] | None = None) -> Job | None:
    """Atomically claim the first queued job of ``kinds`` (None: any kind) in claim order
    (:data:`KIND_RANK`: rank, turns by owner among ``kinds``, priority, age), or return None
    when there is none. A job whose owner's account is disabled is held: never claimed while it
    is (as :func:`admit` holds GPU jobs; :func:`app.store.admission.hold_kind`).

    The job becomes ``running`` with ``lease_owner = worker_id`` and a lease of
    ``lease_seconds`` seconds; ``attempts`` is incremented. The owner's turn is a correlated
    subquery in the one ``UPDATE``'s ``ORDER BY``, so the pick and the write stay one statement.
    """
    kind_sql = turn_kinds = ""
    params: dict[str, Any] = {"w": worker_id, "now": now()}
    params["exp"] = params["now"] + lease_seconds
    if kinds:
        names = ", ".join(f":k{i}" for i in range(len(kinds)))
        kind_sql, turn_kinds = f" AND q.kind IN ({names})", f" AND o.kind IN ({names})"
        params.update({f"k{i}": k for i, k in enumerate(kinds)})
    lock = "" if is_sqlite(engine) else " FOR UPDATE OF q SKIP LOCKED"
    turn = ("(SELECT COALESCE(MAX(o.started_at), 0) FROM jobs o WHERE o.started_at IS NOT NULL"
            f" AND COALESCE(o.owner, '') = COALESCE(q.owner, ''){turn_kinds})")
    sql = text(
        "UPDATE jobs SET state = 'running', lease_owner = :w, lease_expires_at = :exp, "
        "attempts = attempts + 1, started_at = COALESCE(started_at, :now) "
        "WHERE id = (SELECT q.id FROM jobs q WHERE q.state = 'queued' AND q.cancel_requested = :f"
        " AND NOT EXISTS (SELECT 1 FROM users u WHERE u.id = q.owner AND u.disabled = :t)"
        f"{kind_sql} ORDER BY {_rank_sql('q.kind')}, {turn}, q.priority DESC, q.id "
        f"LIMIT 1{lock}) AND state = 'queued' "
        "RETURNING id"
    )
    params["f"], params["t"] = False, True
    with session_scope(engine, immediate=True) as s:
        row = s.execute(sql, params).first()
        if row is None:
            return None
        job = s.get(Job, row[0])
        s.refresh(job)
        _state_event(s, job.id, JobState.RUNNING, worker=worker_id, attempt=job.attempts)
        return job


#: Postgres advisory lock every admission transaction takes, so that admissions (of every
#: supervisor on every host) are serial: a slot's free memory and a user's quota read in one
#: cannot be spent by another at the same time. SQLite's BEGIN IMMEDIATE does the same.
ADMISSION_LOCK = 0x57480015


def admit(engine: Engine, slot: admission.Slot, lease_seconds: float, kinds: Collection[str],
          margin: float, fair_share_hours: float,
          peers: Collection[admission.Slot] = (),
          claims: Collection[tuple[int, str, Collection[str]]] = ()) -> Job | None:
    """Claim for GPU ``slot`` the first queued job of ``kinds`` in admission order that fits
    beside the jobs running there and whose owner is within quota (:mod:`app.store.admission`),
    or return None. ``margin`` and ``fair_share_hours`` are the settings'
    ``gpu_admit_margin`` and ``fair_share_hours`` (one default, in :class:`app.settings.Settings`).

    One transaction: the write lock (``BEGIN IMMEDIATE``; on Postgres also the advisory lock
    :data:`ADMISSION_LOCK`), the admission check, then one fenced ``UPDATE ... WHERE id = :id
    AND state = 'queued'`` that makes it ``running`` with the reservation ``gpu_slot``,
    ``gpu_index`` and ``admitted_gib`` (GiB) and a lease of ``lease_seconds`` seconds owned by
    ``<slot id>:<job id>-<random>`` (the job's own process heartbeats under it; see
    :func:`reap`'s ``restarted_prefix``). ``peers``: the other slots of the supervisor, which a
    data-parallel job (``num_gpus`` > 1) takes together with ``slot``; its ``gpu_slot`` lists
    them all, comma-separated (:func:`app.store.admission.slot_ids`), ``admitted_gib`` is per GPU.

    ``claims``: ``(job id, lease owner, slot ids)`` of each job process the caller still has
    running. A slot one of them is on admits nothing when that job is no longer running under
    that owner (reaped or ended while its process lives on: its memory is in use although no
    row counts it). Read inside this transaction, so a reap that lands between the caller's own
    look at its processes and this admission cannot hand the slot on (trial s22 F12's race;
    :func:`reap` takes the same lock).
    """
    with session_scope(engine, immediate=True) as s:
        if not is_sqlite(engine):
            s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ADMISSION_LOCK})
        held = _orphaned_slots(s, claims)
        if slot.id in held:
            return None
        peers = [p for p in peers if p.id not in held]
        t = now()
        snap = admission.snapshot(s, t, kinds, margin, fair_share_hours)
        choice = admission.pick(snap, slot, peers)
        if choice is None:
            return None
        job, need, group = choice
        owner = f"{slot.id}:{job.id}-{secrets.token_hex(3)}"
        row = s.execute(
            text("UPDATE jobs SET state = 'running', lease_owner = :w, lease_expires_at = :exp, "
                 "attempts = attempts + 1, started_at = COALESCE(started_at, :now), "
                 "gpu_slot = :slot, gpu_index = :idx, admitted_gib = :gib "
                 "WHERE id = :id AND state = 'queued' AND cancel_requested = :f RETURNING id"),
            {"w": owner, "exp": t + lease_seconds, "now": t,
             "slot": ",".join(g.id for g in group), "idx": slot.index,
             "gib": need, "id": job.id, "f": False}).first()
        if row is None:
            return None
        s.refresh(job)
        _state_event(s, job.id, JobState.RUNNING, worker=owner, attempt=job.attempts,
                     gpu=job.gpu_slot, admitted_gib=need)
        return job


def _orphaned_slots(s: Session, claims) -> set[str]:
    """The slot ids of ``claims`` (``(job id, lease owner, slot ids)``) whose job is no longer
    running under that owner (see :func:`admit`)."""
    claims = list(claims)
    if not claims:
        return set()
    rows = s.exec(select(Job).where(col(Job.id).in_([c[0] for c in claims]))).all()
    live = {(j.id, j.lease_owner) for j in rows if j.state == JobState.RUNNING}
    return {sid for job_id, owner, sids in claims if (job_id, owner) not in live for sid in sids}


def move_to_front(engine: Engine, job_id: int) -> Job:
    """Put a queued job first in admission order (an admin's decision; quotas still apply).
    Raises :class:`JobNotFound`; a job no longer queued is returned unchanged."""
    with session_scope(engine, immediate=True) as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(job_id)
        if job.state == JobState.QUEUED:
            job.front_at = now()
            s.add(job)
            events.append(s, job_id, "log", {"level": "info",
                                             "message": "moved to the front of the queue"})
        s.flush()
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


def cancel_requested(engine: Engine, job_id: int) -> bool:
    """Whether a cancel was requested for the job (one read, no write: cheap enough for a
    training step's end, between heartbeats); False for an unknown job."""
    with session_scope(engine) as s:
        row = s.execute(text("SELECT cancel_requested FROM jobs WHERE id = :id"),
                        {"id": job_id}).first()
    return bool(row and row[0])


def _fenced_end(engine: Engine, job_id: int, worker_id: str, state: str,
                error: str | None = None, result: dict[str, Any] | None = None,
                extra_sets: str = "", extra_where: str = "") -> bool:
    with session_scope(engine, immediate=True) as s:
        row = s.execute(
            text(f"UPDATE jobs SET state = :st, finished_at = :now, lease_expires_at = NULL{extra_sets} "
                 f"WHERE id = :id AND lease_owner = :w AND state = 'running'{extra_where} "
                 "RETURNING id"),
            {"st": state, "now": now(), "id": job_id, "w": worker_id, "f": False},
        ).first()
        if row is None:
            return False
        job = s.get(Job, job_id)
        if error is not None:
            job.error = error
        if result is not None:
            job.result = result
            peak = result.get("memory_peak") if isinstance(result, dict) else None
            if isinstance(peak, dict) and peak.get("peak_gib") is not None:
                job.peak_gib, job.peak_kind = float(peak["peak_gib"]), peak.get("kind")
        s.add(job)
        _state_event(s, job_id, state, **({"error": error} if error else {}))
        return True


def finish(engine: Engine, job_id: int, worker_id: str, result: dict[str, Any] | None = None) -> bool:
    """Mark a held job succeeded with ``result``; False if the lease was lost."""
    return _fenced_end(engine, job_id, worker_id, JobState.SUCCEEDED, result=result)


def finish_unless_cancelled(engine: Engine, job_id: int, worker_id: str,
                            result: dict[str, Any] | None = None) -> bool | None:
    """:func:`finish`, in one statement only while no cancel was requested: True when it
    succeeded, None when the job is still held but a cancel was requested (the caller undoes
    what the job wrote and calls :func:`acknowledge_cancel`), False when the lease was lost."""
    if _fenced_end(engine, job_id, worker_id, JobState.SUCCEEDED, result=result,
                   extra_where=" AND cancel_requested = :f"):
        return True
    job = get_job(engine, job_id)
    held = job.state == JobState.RUNNING and job.lease_owner == worker_id
    return None if held and job.cancel_requested else False


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
            _cancel_queued(s, job)
        elif job.state == JobState.RUNNING and not job.cancel_requested:
            job.cancel_requested = True
            events.append(s, job_id, "log", {"level": "info", "message": "cancel requested"})
        s.add(job)
        s.flush()
        return job


def cancel_if_queued(engine: Engine, job_id: int) -> bool:
    """Cancel the job only while it is still queued (one transaction); True when it was. A job
    a worker claimed meanwhile is left running."""
    with session_scope(engine, immediate=True) as s:
        job = s.get(Job, job_id)
        if job is None or job.state != JobState.QUEUED:
            return False
        _cancel_queued(s, job)
        s.add(job)
        return True


def _cancel_queued(session: Session, job: Job) -> None:
    """End a queued ``job`` as cancelled inside the caller's transaction."""
    job.state = JobState.CANCELLED
    job.cancel_requested = True
    job.finished_at = now()
    _state_event(session, job.id, JobState.CANCELLED)


def _memory_note(session: Session, job_id: int) -> str:
    """``"; last measured memory 1.23 GiB RSS, 20.1 GiB GPU"`` from the job's newest
    ``resource`` event (see :func:`record_memory`), or ``""`` when none was recorded."""
    ev = session.exec(select(JobEvent).where(JobEvent.job_id == job_id,
                                             JobEvent.type == "resource")
                      .order_by(JobEvent.id.desc()).limit(1)).first()
    if ev is None:
        return ""
    parts = [f"{ev.data['rss_gib']:.2f} GiB RSS"] if ev.data.get("rss_gib") is not None else []
    if ev.data.get("gpu_gib") is not None:
        parts.append(f"{ev.data['gpu_gib']:.2f} GiB GPU")
    return f"; last measured memory {', '.join(parts)}" if parts else ""


def _reap_reason(job: Job, killed: bool, note: str) -> tuple[str, str]:
    """(new state, reason) for one reaped job."""
    owner = job.lease_owner
    if job.cancel_requested:
        return JobState.CANCELLED, "cancelled; its worker stopped answering"
    cause = (f"the process of worker {owner} was killed (likely out of memory{note})" if killed
             else f"lease of worker {owner} expired (it stopped answering{note})")
    if job.attempts < job.max_attempts:
        return JobState.QUEUED, f"{cause}; requeued"
    return JobState.FAILED, (f"{cause}; failed after {job.attempts} attempts "
                             f"(max_attempts={job.max_attempts})")


def reap(engine: Engine, restarted: str | None = None, gone: Collection[str] = (),
         grace: float = 0.0, restarted_prefix: str | None = None) -> list[tuple[int, str]]:
    """Requeue (attempts left) or fail (none left) running jobs whose lease expired, and, with
    ``restarted`` (a worker id that is starting up), every job still leased to that id: the
    process that held it is gone, so its job need not wait for the lease to run out. Worker ids
    must be unique among live workers (one per GPU slot, see docker/start.sh).

    Args:
        gone: ids of workers whose process is known not to exist any more (their leases still
            expire first); their jobs' reason says the process was killed, likely out of
            memory, with the last memory the worker recorded (:func:`record_memory`); so do
            the jobs of ``restarted``.
        restarted_prefix: like ``restarted`` for every lease owner that starts with it (a
            supervisor's GPU slot ``<slot id>:`` when the supervisor starts: its job processes
            are gone).
        grace: seconds a lease must be past its expiry, to which is added as long as this call
            waited for the write lock (while the database was locked no worker could renew its
            lease, so a healthy worker whose heartbeat was blocked is not reaped). Without
    a candidate the call only reads (no write lock taken), so it is cheap to call every second.

    Returns:
        ``[(job_id, new_state), ...]`` for every job reaped.
    """
    def candidates(s: Session, cutoff: float) -> list[Job]:
        dead = Job.lease_expires_at < cutoff
        if restarted is not None:
            dead = or_(dead, Job.lease_owner == restarted)
        if restarted_prefix:
            dead = or_(dead, func.substr(Job.lease_owner, 1, len(restarted_prefix))
                       == restarted_prefix)
        return list(s.exec(select(Job).where(Job.state == JobState.RUNNING, dead)).all())

    with session_scope(engine) as s:
        if not candidates(s, now() - grace):
            return []
    out: list[tuple[int, str]] = []
    t0 = time.monotonic()
    with session_scope(engine, immediate=True) as s:
        s.execute(text("SELECT 1"))  # takes the write lock (BEGIN IMMEDIATE) before the clock
        if not is_sqlite(engine):  # serial with admissions, as SQLite's write lock makes it
            s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ADMISSION_LOCK})
        t = now()
        waited = time.monotonic() - t0
        for job in candidates(s, t - grace - waited):
            killed = job.lease_owner in gone or (restarted is not None
                                                 and job.lease_owner == restarted) or (
                bool(restarted_prefix) and (job.lease_owner or "").startswith(restarted_prefix))
            job.state, reason = _reap_reason(job, killed, _memory_note(s, job.id))
            if job.state != JobState.QUEUED:
                job.finished_at = t
            if job.state == JobState.FAILED:
                job.error = reason
            job.lease_owner = None
            job.lease_expires_at = None
            s.add(job)
            _state_event(s, job.id, job.state, reason=reason)
            out.append((job.id, job.state))
    return out


def record_memory(engine: Engine, job_id: int, rss_gib: float, gpu_gib: float | None) -> None:
    """Append a ``resource`` event (``{"rss_gib", "gpu_gib"?, "message"}``) with the memory the
    job's worker process uses now, in GiB; :func:`reap` quotes the newest one when the process
    dies (an out-of-memory kill leaves no other trace)."""
    data: dict[str, Any] = {"rss_gib": round(rss_gib, 4)}
    msg = f"memory {rss_gib:.2f} GiB RSS"
    if gpu_gib is not None:
        data["gpu_gib"] = round(gpu_gib, 4)
        msg += f", {gpu_gib:.2f} GiB GPU"
    events.append_many(engine, job_id, [("resource", {**data, "message": msg})])


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
