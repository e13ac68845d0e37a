"""The CPU lane on the queue page (``/queue``, ``/api/queue``): the jobs a worker's CPU lane
claims (:data:`app.store.queue.CPU_KINDS`: exports, model imports, dataset validations), running
and waiting, each waiting one with why it waits and an estimated start.

Every live worker has one CPU lane (its worker row's device ends with :data:`LANE_SUFFIX`) that
runs one job at a time, taking jobs in claim order, with turns by owner
(:data:`app.store.queue.KIND_RANK`, replayed by :func:`in_claim_order`); a job that waits while
newer jobs of other owners take their turn says so. A running
job frees its lane at its ETA: its newest ``eta_seconds`` metric, else the median duration of
recent succeeded jobs of its kind less the time it has run (0 when overdue). The waiting jobs are
replayed over the lanes in claim order: each takes the lane that frees first and holds it for
its kind's median duration; a start is unknown when no lane's freeing time is known.

Other users' jobs are anonymous slots, as on the GPU lane (the caller passes ``slot_of``).
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from sqlmodel import select

from app.store.queue import CPU_KINDS, claim_key, claim_order, last_turns
from app.store.schema import Job, JobState

#: Why a CPU-lane job of a disabled account waits (the claim skips it; any reader).
HELD_DISABLED = "held: its owner's account is disabled; enabling it again releases the job"
#: The device suffix of a worker row that is a CPU lane (worker/loop.py ``start_cpu_lane``).
LANE_SUFFIX = "(cpu lane)"


@dataclass
class CpuLaneView:
    """The CPU lanes: ``lanes`` (live lane count), ``running`` and ``waiting`` job slots
    (:class:`app.studio.queue_view.JobSlot`, seconds)."""

    lanes: int
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)


def typical_seconds(s, kind: str, on_gpu: bool = False) -> float | None:
    """Median seconds (start to end) of the 20 newest succeeded jobs of ``kind`` (``on_gpu``:
    only those admitted to a GPU slot); None without any."""
    q = select(Job.started_at, Job.finished_at).where(Job.kind == kind,
                                                      Job.state == JobState.SUCCEEDED)
    if on_gpu:
        q = q.where(Job.gpu_slot.is_not(None))
    rows = s.exec(q.order_by(Job.id.desc()).limit(20)).all()
    spans = [f - st for st, f in rows if st and f and f > st]
    return median(spans) if spans else None


def seconds_left(job: Job, eta: float | None, span: float | None, t: float) -> float | None:
    """Seconds until running ``job`` ends at ``t`` (epoch): ``eta`` (its own ``eta_seconds``
    metric, already aged) when known, else ``span`` (the median seconds of its kind, from
    :func:`typical_seconds`) less the time it has run, 0 when overdue; None when neither is
    known (no ETA metric yet and no finished job of its kind)."""
    if eta is None and span and job.started_at:
        eta = max(0.0, span - (t - job.started_at))
    return eta


def in_claim_order(s, jobs: list[Job]) -> list[Job]:
    """``jobs`` (queued and running, any lane) sorted by :func:`app.store.queue.claim_key`, with
    the queued CPU-lane jobs reordered in place into the lane's turns by owner (session ``s``
    reads each owner's last turn), so positions follow what the lane will really claim."""
    jobs = sorted(jobs, key=claim_key)
    at = [i for i, j in enumerate(jobs) if j.state == JobState.QUEUED and j.kind in CPU_KINDS]
    if len(at) > 1:
        turns = claim_order([jobs[i] for i in at], last_turns(s, CPU_KINDS))
        for i, job in zip(at, turns):
            jobs[i] = job
    return jobs


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def cpu_lane(lanes: int, jobs: list[Job], typical: dict[str, float | None], t: float,
             eta_of: Callable[[Job], float | None], slot_of: Callable[..., Any],
             disabled: Collection[str] = ()) -> CpuLaneView:
    """The CPU lane view from the queued and running CPU-lane ``jobs`` in claim order
    (:func:`in_claim_order`).

    Args:
        lanes: live CPU lanes (each runs one job at a time).
        typical: kind -> median seconds of a succeeded job (None: unknown).
        t: now (epoch seconds).
        eta_of: a running job's seconds left by its own ``eta_seconds`` metric, else None.
        slot_of: ``(job, need_gib, **fields) -> JobSlot`` (hides other users' jobs).
        disabled: ids of disabled accounts: their waiting jobs are held (the claim skips
            them), listed last with :data:`HELD_DISABLED` and no start.
    """
    view = CpuLaneView(lanes)
    free_in: list[float | None] = []  # per busy lane: seconds until it frees (None: unknown)
    for job in (j for j in jobs if j.state == JobState.RUNNING):
        eta = seconds_left(job, eta_of(job), typical.get(job.kind), t)
        view.running.append(slot_of(job, None, eta_seconds=eta))
        free_in.append(eta)
    free_in += [0.0] * max(0, lanes - len(free_in))
    ahead = len(view.running)
    queued = [j for j in jobs if j.state == JobState.QUEUED and j.owner not in disabled]
    held = [j for j in jobs if j.state == JobState.QUEUED and j.owner in disabled]
    for pos, job in enumerate(queued, 1):
        start = None
        if not lanes:
            reason = "no worker is running"
        else:
            known = [(f, i) for i, f in enumerate(free_in) if f is not None]
            if known:
                start, lane = min(known)
                span = typical.get(job.kind)
                free_in[lane] = start + span if span is not None else None
            if start is not None and start < 1e-9 and pos <= lanes - len(view.running):
                reason = "starts at the next poll"
            else:
                each = "runs one job at a time" if lanes == 1 else \
                    f"has {lanes} lanes, each running one job at a time"
                reason = f"behind {_plural(ahead, 'job')}: the CPU lane {each}"
                newer = sum(claim_key(j) > claim_key(job) for j in queued[:pos - 1])
                if newer:
                    reason += (f"; waits for its turn: the lane takes turns by owner, "
                               f"{_plural(newer, 'newer job')} of other owners first")
        view.waiting.append(slot_of(job, None, reason=reason, start_in_seconds=start,
                                    position=pos))
        ahead += 1
    view.waiting += [slot_of(job, None, reason=HELD_DISABLED, position=len(queued) + i)
                     for i, job in enumerate(held, 1)]
    return view
