"""A run's training time over all its attempts (a cancelled or failed run resumed is trained in
segments, one per job; each ``trainer.train`` reports only its own).

The worker records each segment as a log event with ``segment = {"job_id", "from_step",
"to_step", "train_runtime"}`` (:func:`worker.jobs.common.record_segment`), and a resumed job
carries the earlier jobs' log events, so the current job's events hold every segment.
"""
from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from app.store import events
from app.store.schema import Job


def segments(engine: Engine, job: Job) -> list[dict[str, Any]]:
    """The training segments recorded in ``job``'s events, oldest first (see module doc)."""
    out = []
    for ev in events.since(engine, job.id, 0, limit=1_000_000, types=["log"]):
        seg = (ev.data or {}).get("segment")
        if isinstance(seg, dict) and isinstance(seg.get("train_runtime"), (int, float)):
            out.append(seg)
    return out


def training_time(engine: Engine, job: Job | None) -> dict[str, Any] | None:
    """The run's training time in seconds: ``this_attempt`` (the segments of ``job``, the
    run's current job), ``all_attempts`` (the sum over every segment of the run: the run's
    total) and ``attempts`` (how many segments), rounded to 0.001 s; ``resumed`` when an
    earlier attempt trained too. A job trained before segments were recorded counts its
    ``result.train_runtime`` as its one segment. None when nothing was trained yet."""
    if job is None:
        return None
    segs = segments(engine, job)
    if not segs:
        runtime = (job.result or {}).get("train_runtime")
        if not isinstance(runtime, (int, float)):
            return None
        segs = [{"job_id": job.id, "train_runtime": runtime}]
    this = sum(s["train_runtime"] for s in segs if s.get("job_id") == job.id)
    total = sum(s["train_runtime"] for s in segs)
    return {"this_attempt": round(this, 3), "all_attempts": round(total, 3),
            "attempts": len(segs), "resumed": len(segs) > 1}
