"""Where a run's job stands, for its run page: while queued, its place in the queue with the
reason the Queue page gives (:func:`app.studio.queue_view.queue_view`, one rule for both pages);
its ETA from the current attempt only; and whether it runs (or will run) on a GPU, so that a
CPU-only box's run page does not speak of GPU memory and CUDA context.
"""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Engine

from app.settings import Settings
from app.store import workers
from app.store.schema import Job, JobState, User
from app.studio.queue_view import attempt_metric, queue_view
from app.studio.worker_view import any_gpu


@dataclass
class RunPlace:
    """A run's job as its page shows it beside the live tiles.

    ``queued``: the job waits; then ``position`` (1 = next; None when the queue does not list
    it), ``reason`` (why it waits, the Queue page's words), ``start_in_seconds`` (estimated
    start, None: unknown) and ``text`` (all of it in one sentence, e.g. ``"2nd in the queue:
    no GPU has room: needs 7.1 GiB, largest free 0.7 GiB; estimated start: unknown"``).
    ``eta_seconds``: seconds left of the running attempt as its newest metric reported them
    (the live page shows each metric's, so a reload agrees; None: not running or not reported
    yet). ``on_gpu``: False when the job ran, runs or will run on the CPU (a CPU slot, no GPU
    worker live), True on a GPU, None when nothing tells (no live worker)."""

    queued: bool
    position: int | None = None
    reason: str | None = None
    start_in_seconds: float | None = None
    text: str | None = None
    eta_seconds: float | None = None
    on_gpu: bool | None = None


def ordinal(n: int) -> str:
    """``1`` -> ``"1st"``, ``2`` -> ``"2nd"``, ``13`` -> ``"13th"``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _starts(seconds: float | None) -> str:
    if seconds is None:
        return "estimated start: unknown"
    m, s = divmod(int(seconds), 60)
    return f"estimated start in {m} min {s:02d} s" if m else f"estimated start in {s} s"


def on_gpu(engine: Engine, settings: Settings, job: Job | None) -> bool | None:
    """Whether ``job`` ran, runs or will run on a GPU (see :class:`RunPlace`)."""
    if job is None:
        return None
    if job.peak_kind:
        return job.peak_kind == "gpu"
    live = workers.live(engine, settings.worker_stale_seconds)
    if job.gpu_slot:
        slot = next((w for w in live if w.id == job.gpu_slot), None)
        if slot is not None:
            return slot.gpu_capacity_gib is not None
    return any_gpu(live)


def run_place(engine: Engine, settings: Settings, actor: User, job: Job | None) -> RunPlace:
    """``job``'s place (``actor`` may see it: the caller checked) as :class:`RunPlace`."""
    gpu = on_gpu(engine, settings, job)
    if job is None or job.state != JobState.QUEUED:
        m = attempt_metric(engine, job) if job is not None else None
        eta = m["eta_seconds"] if m else None
        return RunPlace(False, eta_seconds=eta, on_gpu=gpu)
    view = queue_view(engine, settings, actor)
    row = next((r for r in view.waiting + view.cpu.waiting if r.job_id == job.id), None)
    if row is None:
        return RunPlace(True, text="queued: it waits for a worker to take it", on_gpu=gpu)
    text = f"{ordinal(row.position)} in the queue: {row.reason}"
    if row.note:
        text += f"; {row.note}"
    start = row.start_in_seconds
    if start is None or start >= 1:  # at once: the reason says "starts at the next admission"
        text += f"; {_starts(start)}"
    return RunPlace(True, row.position, row.reason, start, text, None, gpu)
