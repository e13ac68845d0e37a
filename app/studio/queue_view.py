"""The queue page (``/queue``, ``/api/queue``): per GPU the running jobs with their memory and
ETA; the waiting GPU jobs in admission order, each with why it waits and an estimated start.

The reasons replay admission (:mod:`app.store.admission`) over the live GPU slots: the jobs are
taken in admission order; a job whose owner is over quota says which quota; one that fits a slot's
free memory now (after the jobs ahead took theirs) starts at the next poll; else it waits for room
("no GPU has room: needs X GiB, largest free Y GiB", or "behind N jobs" when the memory is free
but the jobs ahead take it first). The estimated start is when enough admitted memory frees on one
slot: a running job frees it at its ETA (its newest ``eta_seconds`` metric; before its first,
its length less the time it has run), a job placed ahead after its length; unknown when a needed
end is. A training job's length is its planned steps at the pace of recent jobs of its kind and
model (:mod:`app.studio.queue_pace`), else (and for other kinds) the median duration of recent
succeeded jobs of its kind. The estimate is the
same whoever reads it (a member's own job may wait behind jobs she sees only as anonymous slots).

On a machine without a GPU the supervisor's CPU slot runs one training job at a time: a job
waits for it (not for GPU memory), and starts when the running job's ETA and the median durations
of the jobs placed before it have passed. The CPU lane (exports, imports, dataset validations;
:mod:`app.studio.queue_cpu`) is shown beside, with its own running and waiting jobs.

A running playground session holds its slot while its model is loaded; idle
``settings.playground_yield_seconds`` (default 15) while a job waits for that slot, it gives the
slot up (worker/jobs/playground.py). Its row's ``note`` says so in plain words (loading, answering
a prompt, or idle for how long, and which job it would give its slot to), and a waiting job held
up by a session has a ``note`` naming it (:func:`session_notes`).

A member sees their own jobs in full and other users' as anonymous slots (memory, state and ETA
only; a playground session's note without its owner or id); an admin sees everything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.settings import Settings
from app.store import admission, events, workers
from app.store.db import session_scope
from app.store.queue import CPU_KINDS
from app.store.schema import Job, JobState, Run, User, now
from app.studio import access
from app.studio.estimate import memory_words
from app.studio.queue_cpu import (LANE_SUFFIX, CpuLaneView, cpu_lane, in_claim_order,
                                  seconds_left, typical_seconds)
from app.studio.queue_pace import paces, planned_seconds

#: Kinds that wait for a slot (a GPU's memory, or the CPU slot of a box without one): a
#: playground session holds one while its model is loaded, so it waits like a training job.
GPU_KINDS = ("train", "grpo", "evaluate", "playground")


@dataclass
class JobSlot:
    """One job as the queue page shows it; ``visible`` False: another user's (no id, name).
    ``need_gib`` is what admission holds of a slot (:func:`app.store.admission.need_gib`);
    ``memory`` the job's estimate in the words every page uses
    (:func:`app.studio.estimate.memory_words`, with ``admitted``; None: no estimate)."""

    visible: bool
    job_id: int | None
    run_id: str | None
    kind: str | None
    owner: str | None
    need_gib: float | None
    eta_seconds: float | None = None
    reason: str | None = None
    start_in_seconds: float | None = None
    position: int | None = None
    front: bool = False
    #: plain words about a playground session this row is or waits behind (None: none)
    note: str | None = None
    #: the run's name (None: no run, or another user's)
    run_name: str | None = None
    memory: dict[str, Any] | None = None


@dataclass
class GpuView:
    """One GPU slot with its running jobs (GiB)."""

    id: str
    host: str
    index: int | None
    device: str
    total_gib: float | None
    capacity_gib: float | None
    admitted_gib: float
    running: list[JobSlot] = field(default_factory=list)


@dataclass
class QueueView:
    """The whole page."""

    gpus: list[GpuView]
    waiting: list[JobSlot]
    is_admin: bool
    cpu: CpuLaneView = field(default_factory=lambda: CpuLaneView(0))
    #: seconds an idle playground session keeps a slot a waiting job needs
    playground_yield_seconds: float = 15.0


def attempt_metric(engine: Engine, job: Job) -> dict[str, Any] | None:
    """The newest metric of ``job``'s current attempt that has ``eta_seconds`` (its data), or
    None: unless the job is running, and unless that metric came after its newest ``running``
    state event (a resumed run's job starts with the metrics of the attempt before it, and a
    requeued job keeps its earlier attempt's: their ETA is not this attempt's)."""
    if job.state != JobState.RUNNING:
        return None
    ev = events.latest(engine, job.id, "metric")
    if ev is None or ev.data.get("eta_seconds") is None:
        return None
    started = next((e for e in events.recent(engine, job.id, "state", 20)
                    if e.data.get("state") == JobState.RUNNING), None)
    if started is None or ev.id < started.id:
        return None
    return {**ev.data, "ts": ev.ts}


def attempt_eta(engine: Engine, job: Job, t: float) -> float | None:
    """Seconds left of ``job``'s current attempt at ``t`` (epoch): its
    :func:`attempt_metric`'s ``eta_seconds`` less the time since it was reported; None when
    there is none."""
    m = attempt_metric(engine, job)
    if m is None:
        return None
    return max(0.0, float(m["eta_seconds"]) - (t - m["ts"]))


def _secs(x: float) -> str:
    """``x`` seconds in plain words: ``"15 s"`` under two minutes, else ``"3 min"``."""
    return f"{int(x)} s" if x < 120 else f"{int(x // 60)} min"


def session_state(engine: Engine, job: Job, t: float) -> tuple[str, float | None]:
    """A running playground session's state from its events: ``("loading", None)`` before its
    model is loaded, ``("busy", None)`` while a prompt is unanswered, else ``("idle", seconds
    since its last answer or its load)``."""
    ready = events.latest(engine, job.id, "session")
    if ready is None:
        return "loading", None
    prompt = events.latest(engine, job.id, "prompt")
    answer = events.latest(engine, job.id, "answer")
    if prompt is not None and (answer is None or answer.id < prompt.id):
        return "busy", None
    last = max(ready.ts, answer.ts if answer is not None else 0.0)
    return "idle", max(0.0, t - last)


def session_notes(state: tuple[str, float | None], yield_s: float, waiter: str | None,
                  holder: str) -> tuple[str, str | None]:
    """(note of the session's own row, note of the job waiting for its slot or None).

    ``state`` is :func:`session_state`'s; ``yield_s`` the session's own yield (its payload's
    ``yield_seconds``, which the worker counts: :func:`session_yield`); ``waiter`` names the
    first job waiting for the session's slot (``"job 7"``; None: none waits); ``holder`` names
    the session for that job's row. The idle time and the time to the yield add up to the
    yield (``idle 4 s`` ... ``in 11 s (at 15 s idle)``); past it, the session gives the slot up
    at its next check (every second, worker/jobs/playground.py)."""
    what, idle = state
    rule = f"gives its slot to waiting jobs after {_secs(yield_s)} idle"
    if what in ("loading", "busy"):
        doing = "loading its model" if what == "loading" else "answering a prompt"
        own = f"playground session, {doing}; once idle it {rule}"
        if waiter is None:
            return own, None
        return own, (f"waits for {holder}: an idle playground session {rule}; it is {doing} "
                     "now")
    since = f"idle {_secs(idle)}"
    if waiter is None:
        return (f"idle playground session, {since}: no job waits for its slot; it gives the "
                f"slot up after {_secs(yield_s)} idle when one does"), None
    if idle >= yield_s:
        return (f"idle playground session, {since}, past its {_secs(yield_s)} yield: it gives "
                f"its slot to {waiter} within seconds"), (
                f"waits for {holder}: {since}, past its {_secs(yield_s)} yield; it gives its "
                "slot within seconds")
    left = (f"in {_secs(math.ceil(yield_s - idle))} (at {_secs(yield_s)} idle) unless it gets "
            "a prompt")
    return (f"idle playground session, {since}: gives its slot to {waiter} {left}",
            f"waits for {holder}: {since}; it gives its slot {left}")


def session_yield(job: Job, settings: Settings) -> float:
    """Seconds idle after which the playground session ``job`` gives its slot to a waiting
    job: its payload's ``yield_seconds`` (fixed when it started; what its worker counts), else
    the settings' ``playground_yield_seconds``."""
    y = (job.payload or {}).get("yield_seconds")
    return float(y) if y is not None else float(settings.playground_yield_seconds)


def _frees_in(ends: list[float | None], t: float) -> float | None:
    """Seconds until every job of a slot has ended (its ``ends``, epoch), None if one is unknown."""
    if any(e is None for e in ends):
        return None
    return max([0.0, *(e - t for e in ends)])


def _earliest(holds: dict[str, list[tuple[float, float | None]]], slots, need, t: float):
    """(slot id, seconds from now) when ``need`` GiB first fits on one slot, else None."""
    best = None
    for slot in slots:
        if slot.capacity_gib is None or need is None:
            continue
        h = holds[slot.id]
        for at in sorted({t, *(end for _, end in h if end is not None and end > t)}):
            held = sum(g for g, end in h if end is None or end > at)
            if slot.capacity_gib - held >= need - 1e-9:
                if best is None or at - t < best[1]:
                    best = (slot.id, at - t)
                break
    return best


def queue_view(engine: Engine, settings: Settings, actor: User,
               kinds: tuple[str, ...] = GPU_KINDS) -> QueueView:
    """The queue of GPU jobs (``kinds``) as ``actor`` may see it (see the module docstring)."""
    live = workers.live(engine, settings.worker_stale_seconds)
    slots = admission.slots_of(live)
    labels = {w.id: w.device for w in live}
    kinds = [k for k in kinds if k not in CPU_KINDS]
    with session_scope(engine) as s:
        t = now()
        snap = admission.snapshot(s, t, kinds, settings.gpu_admit_margin,
                                  settings.fair_share_hours)
        ordered = admission.order(snap)
        cpu_jobs = in_claim_order(s, s.exec(select(Job).where(
            Job.kind.in_(CPU_KINDS), Job.state.in_([JobState.QUEUED, JobState.RUNNING]))).all())
        ids = {j.run_id for j in snap.running + ordered + cpu_jobs if j.run_id}
        runs = {r.id: r for r in s.exec(select(Run).where(Run.id.in_(ids)))} if ids else {}
        run_owner = {k: r.owner for k, r in runs.items()}
        run_name = {k: r.name for k, r in runs.items()}
        users = list(s.exec(select(User)))
        names = {u.id: u.name for u in users}
        disabled = {u.id for u in users if u.disabled}
        typical = {k: typical_seconds(s, k, on_gpu=True)
                   for k in {j.kind for j in ordered + snap.running}}
        typical.update({k: typical_seconds(s, k) for k in {j.kind for j in cpu_jobs}})
        known = paces(s, {j.kind for j in ordered + snap.running})
    spans: dict[int, float | None] = {}

    def span_of(job: Job) -> float | None:
        """Seconds ``job`` takes in all: its planned steps at its kind's pace, else the median
        duration of its kind (:mod:`app.studio.queue_pace`)."""
        if job.id not in spans:
            planned = planned_seconds(engine, job, runs.get(job.run_id), known)
            spans[job.id] = planned if planned is not None else typical.get(job.kind)
        return spans[job.id]

    def slot_of(job: Job, need, on_gpu: bool = True, **extra: Any) -> JobSlot:
        """The job's row; ``on_gpu`` False: it runs (or will run) on a CPU slot."""
        owner = run_owner.get(job.run_id, job.owner) if job.run_id else job.owner
        if access.can_see(actor, owner):
            return JobSlot(True, job.id, job.run_id, job.kind, names.get(owner, owner), need,
                           run_name=run_name.get(job.run_id),
                           memory=memory_words(job.estimate_gib, job.kind, need, snap.margin,
                                               on_gpu),
                           **extra)
        return JobSlot(False, None, None, None, None, need, **extra,
                       memory=memory_words(job.estimate_gib, None, need, snap.margin, on_gpu))

    gpus, holds, sessions = [], {}, []
    for slot in slots:
        view = GpuView(slot.id, slot.host, slot.index, labels.get(slot.id, ""), slot.total_gib,
                       slot.capacity_gib, round(snap.held(slot.id)[0], 2))
        holds[slot.id] = []
        for job in (j for j in snap.running if slot.id in admission.slot_ids(j)):
            eta = attempt_eta(engine, job, t)
            if job.kind != "playground":  # a session has no typical length: it yields
                eta = seconds_left(job, eta, span_of(job), t)
            holds[slot.id].append((job.admitted_gib or 0.0, t + eta if eta is not None else None))
            view.running.append(slot_of(job, job.admitted_gib, slot.capacity_gib is not None,
                                        eta_seconds=eta))
            if job.kind == "playground":
                sessions.append((view, view.running[-1], job))
        gpus.append(view)
    # playground sessions: their state, and the job each keeps waiting (before the replay)
    by_id = {j.id: j for j in ordered}
    waits_on: dict[int, str] = {}
    yield_s = settings.playground_yield_seconds
    for view, row, job in sessions:
        waiter = admission.waits_for(snap, job, slots)
        name = None if waiter is None else (f"job {waiter.id}" if slot_of(waiter, None).visible
                                            else "a waiting job")
        where = "the CPU slot" if view.capacity_gib is None else (view.device or view.id)
        holder = (f"playground session job {job.id}" if row.visible
                  else "another user's playground session") + f" on {where}"
        row.note, theirs = session_notes(session_state(engine, job, t),
                                         session_yield(job, settings), name, holder)
        if waiter is not None and waiter.id in by_id and theirs:
            waits_on[waiter.id] = theirs
    # replay admission over the waiting jobs
    owners = {k: admission.Owner(**vars(v)) for k, v in snap.owners.items()}
    free_now = {sl.id: snap.free(sl) for sl in slots}
    cpu_busy = {sl.id: snap.held(sl.id)[1] > 0 for sl in slots if sl.capacity_gib is None}
    # a CPU slot runs one job at a time: seconds until it frees (None: unknown)
    cpu_free = {i: 0.0 if not busy else _frees_in([e for _, e in holds[i]], t)
                for i, busy in cpu_busy.items()}
    cpu_ahead = sum(cpu_busy.values())
    largest_cap = max((sl.capacity_gib for sl in slots if sl.capacity_gib is not None),
                      default=None)
    waiting, placed = [], 0
    for pos, job in enumerate(ordered, 1):
        need = admission.need_gib(job.estimate_gib, snap.margin, largest_cap)
        owner = owners[job.owner]
        total = None if need is None else need * snap.gpus.get(job.id, 1)  # as admission counts
        quota = admission.quota_reason(owner, total, None if job.owner == actor.id
                                       else names.get(job.owner, job.owner))
        start = None
        if quota:
            reason = quota
        elif not slots:
            reason = "no GPU worker is running"
        elif largest_cap is not None and need is not None and need > largest_cap + 1e-9:
            reason = (f"too big for every GPU: needs {need:.1f} GiB, the largest admits "
                      f"{largest_cap:.1f} GiB")
        elif snap.gpus.get(job.id, 1) > 1:  # data-parallel: N GPUs of one host at once
            n, room = snap.gpus[job.id], {}
            for sl in slots:
                if sl.capacity_gib is not None and need is not None \
                        and need <= free_now[sl.id] + 1e-9:
                    room.setdefault(sl.host, []).append(sl)
            group = next((g[:n] for g in room.values() if len(g) >= n), None)
            if group is not None:
                reason, start = "starts at the next admission", 0.0
                for sl in group:
                    free_now[sl.id] -= need
                placed += 1
            else:
                most = max((len(g) for g in room.values()), default=0)
                reason = (f"needs {n} GPUs of one host with {need or 0.0:.1f} GiB free on each "
                          f"at once; {most} GPU{'s' if most != 1 else ''} of one host "
                          f"{'have' if most != 1 else 'has'} room now")
        else:
            fit = next((sl for sl in slots if sl.capacity_gib is not None
                        and need <= free_now[sl.id] + 1e-9), None)
            fit = fit or next((sl for sl in slots if sl.capacity_gib is None
                               and not cpu_busy[sl.id]), None)
            if fit is not None:
                reason, start = "starts at the next admission", 0.0
                if fit.capacity_gib is None:
                    cpu_busy[fit.id] = True
                    span = span_of(job)
                    cpu_free[fit.id] = span
                    cpu_ahead += 1
                else:
                    free_now[fit.id] -= need
                    span = span_of(job)
                    holds[fit.id].append((need, t + span if span else None))
                owner.running += 1
                owner.held_gib += need or 0.0
                placed += 1
            else:
                largest_free = max((snap.free(sl) for sl in slots if sl.capacity_gib is not None),
                                   default=0.0)
                # waits for a CPU slot: behind every job ahead there, whether or not when
                # they end is known (only its estimated start depends on that)
                on_cpu_slot = False
                if need is not None and need <= largest_free + 1e-9:
                    reason = (f"behind {placed} job{'s' if placed != 1 else ''} that take "
                              "the free memory first")
                elif need is None or not any(sl.capacity_gib is not None for sl in slots):
                    reason = (f"behind {cpu_ahead} job{'s' if cpu_ahead != 1 else ''}: the CPU "
                              "slot (no GPU) runs one job at a time")
                    on_cpu_slot = True
                else:
                    reason = (f"no GPU has room: needs {need:.1f} GiB, largest free "
                              f"{max(largest_free, 0.0):.1f} GiB")
                when = _earliest(holds, slots, need, t)
                span = span_of(job)
                on_cpu = min(((f, i) for i, f in cpu_free.items() if f is not None),
                             default=None)
                if on_cpu is not None and (when is None or on_cpu[0] < when[1]):
                    start = on_cpu[0]
                    cpu_free[on_cpu[1]] = start + span if span else None
                    on_cpu_slot = True
                elif when is not None:
                    start = when[1]
                    holds[when[0]].append((need, t + start + span if span else None))
                if on_cpu_slot and cpu_free:
                    cpu_ahead += 1
        # a box whose slots are all CPU slots runs it on one (no GPU words)
        row = slot_of(job, need, not (slots and largest_cap is None), reason=reason,
                      start_in_seconds=start, position=pos, front=job.front_at is not None)
        if not row.visible and quota:
            held = admission.hold_kind(owner)
            row.reason = admission.HELD_ANONYMOUS[held] if held else "over its owner's quota"
        row.note = waits_on.get(job.id)
        waiting.append(row)
    lanes = sum(1 for w in live if w.device.endswith(LANE_SUFFIX))
    cpu = cpu_lane(lanes, cpu_jobs, typical, t, lambda j: attempt_eta(engine, j, t), slot_of,
                   disabled)
    return QueueView(gpus, waiting, access.is_admin(actor), cpu, yield_s)


def as_json(view: QueueView) -> dict[str, Any]:
    """The view as the ``/api/queue`` JSON (GiB, seconds)."""
    def job(j: JobSlot) -> dict[str, Any]:
        d = {k: v for k, v in vars(j).items()}
        d["need_gib"] = None if j.need_gib is None else round(j.need_gib, 2)
        return d
    return {"gpus": [{**{k: v for k, v in vars(g).items() if k != "running"},
                      "running": [job(j) for j in g.running]} for g in view.gpus],
            "waiting": [job(j) for j in view.waiting],
            "playground_yield_seconds": view.playground_yield_seconds,
            "cpu": {"lanes": view.cpu.lanes, "running": [job(j) for j in view.cpu.running],
                    "waiting": [job(j) for j in view.cpu.waiting]}}
