"""The queue page (``/queue``, ``/api/queue``): per GPU the running jobs with their memory and
ETA; the waiting GPU jobs in admission order, each with why it waits and an estimated start.

The reasons replay admission (:mod:`app.store.admission`) over the live GPU slots: the jobs are
taken in admission order; a job whose owner is over quota says which quota; one that fits a slot's
free memory now (after the jobs ahead took theirs) starts at the next poll; else it waits for room
("no GPU has room: needs X GiB, largest free Y GiB", or "behind N jobs" when the memory is free
but the jobs ahead take it first). The estimated start is when enough admitted memory frees on one
slot: a running job frees it at its ETA (its newest ``eta_seconds`` metric), a job placed ahead
after the median duration of recent succeeded jobs of its kind; unknown when a needed end is.

A member sees their own jobs in full and other users' as anonymous slots (memory, state and ETA
only); an admin sees everything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.settings import Settings
from app.store import admission, events, workers
from app.store.db import session_scope
from app.store.queue import CPU_KINDS
from app.store.schema import Job, JobState, Run, now
from app.studio import access

if TYPE_CHECKING:
    from app.store.schema import User

GPU_KINDS = ("train", "grpo", "evaluate")


@dataclass
class JobSlot:
    """One job as the queue page shows it; ``visible`` False: another user's (no id, name)."""

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


def _eta(engine: Engine, job: Job, t: float) -> float | None:
    ev = events.latest(engine, job.id, "metric")
    if ev is None or ev.data.get("eta_seconds") is None:
        return None
    return max(0.0, float(ev.data["eta_seconds"]) - (t - ev.ts))


def _typical_seconds(s, kind: str) -> float | None:
    rows = s.exec(select(Job.started_at, Job.finished_at).where(
        Job.kind == kind, Job.state == JobState.SUCCEEDED, Job.gpu_slot.is_not(None))
        .order_by(Job.id.desc()).limit(20)).all()
    spans = [f - st for st, f in rows if st and f and f > st]
    return median(spans) if spans else None


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
        ids = {j.run_id for j in snap.running + ordered if j.run_id}
        run_owner = {r.id: r.owner for r in s.exec(select(Run).where(Run.id.in_(ids)))} \
            if ids else {}
        typical = {k: _typical_seconds(s, k) for k in {j.kind for j in ordered}}

    def slot_of(job: Job, need, **extra: Any) -> JobSlot:
        owner = run_owner.get(job.run_id, job.owner) if job.run_id else job.owner
        if access.can_see(actor, owner):
            return JobSlot(True, job.id, job.run_id, job.kind, snap.owners[job.owner].name
                           if job.owner in snap.owners else owner, need, **extra)
        return JobSlot(False, None, None, None, None, need, **extra)

    gpus, holds = [], {}
    for slot in slots:
        view = GpuView(slot.id, slot.host, slot.index, labels.get(slot.id, ""), slot.total_gib,
                       slot.capacity_gib, round(snap.held(slot.id)[0], 2))
        holds[slot.id] = []
        for job in (j for j in snap.running if slot.id in admission.slot_ids(j)):
            eta = _eta(engine, job, t)
            holds[slot.id].append((job.admitted_gib or 0.0, t + eta if eta is not None else None))
            view.running.append(slot_of(job, job.admitted_gib, eta_seconds=eta))
        gpus.append(view)
    # replay admission over the waiting jobs
    owners = {k: admission.Owner(**vars(v)) for k, v in snap.owners.items()}
    free_now = {sl.id: snap.free(sl) for sl in slots}
    cpu_busy = {sl.id: snap.held(sl.id)[1] > 0 for sl in slots if sl.capacity_gib is None}
    largest_cap = max((sl.capacity_gib for sl in slots if sl.capacity_gib is not None),
                      default=None)
    waiting, placed = [], 0
    for pos, job in enumerate(ordered, 1):
        need = admission.need_gib(job.estimate_gib, snap.margin, largest_cap)
        owner = owners[job.owner]
        quota = admission.quota_reason(owner, need)
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
                else:
                    free_now[fit.id] -= need
                    span = typical.get(job.kind)
                    holds[fit.id].append((need, t + span if span else None))
                owner.running += 1
                owner.held_gib += need or 0.0
                placed += 1
            else:
                largest_free = max((snap.free(sl) for sl in slots if sl.capacity_gib is not None),
                                   default=0.0)
                if need is not None and need <= largest_free + 1e-9:
                    reason = (f"behind {placed} job{'s' if placed != 1 else ''} that take "
                              "the free memory first")
                elif need is None:
                    reason = "waiting for the CPU slot"
                else:
                    reason = (f"no GPU has room: needs {need:.1f} GiB, largest free "
                              f"{max(largest_free, 0.0):.1f} GiB")
                when = _earliest(holds, slots, need, t)
                if when is not None:
                    start = when[1]
                    span = typical.get(job.kind)
                    holds[when[0]].append((need, t + start + span if span else None))
        row = slot_of(job, need, reason=reason, start_in_seconds=start, position=pos,
                      front=job.front_at is not None)
        if not row.visible and quota:
            row.reason = "over its owner's quota"
        waiting.append(row)
    return QueueView(gpus, waiting, access.is_admin(actor))


def as_json(view: QueueView) -> dict[str, Any]:
    """The view as the ``/api/queue`` JSON (GiB, seconds)."""
    def job(j: JobSlot) -> dict[str, Any]:
        d = {k: v for k, v in vars(j).items()}
        d["need_gib"] = None if j.need_gib is None else round(j.need_gib, 2)
        return d
    return {"gpus": [{**{k: v for k, v in vars(g).items() if k != "running"},
                      "running": [job(j) for j in g.running]} for g in view.gpus],
            "waiting": [job(j) for j in view.waiting]}
