"""A run's training time over all its attempts (a cancelled or failed run resumed is trained in
segments, one per job; each ``trainer.train`` reports only its own).

The worker records each segment as a log event with ``segment = {"job_id", "from_step",
"to_step", "train_runtime"}`` (:func:`worker.jobs.common.record_segment`), and a resumed job
carries the earlier jobs' log events, so the current job's events hold every segment.

A segment is recorded when its attempt ends, so while a job is running its own stretch is
measured from its step metric events (:func:`running_seconds`) and counted as one more
segment (``running``).
"""
from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from app.store import events
from app.store.schema import Job, JobState


def segments(engine: Engine, job: Job) -> list[dict[str, Any]]:
    """The training segments recorded in ``job``'s events, oldest first (see module doc)."""
    out = []
    for ev in events.since(engine, job.id, 0, limit=1_000_000, types=["log"]):
        seg = (ev.data or {}).get("segment")
        if isinstance(seg, dict) and isinstance(seg.get("train_runtime"), (int, float)):
            out.append(seg)
    return out


def running_seconds(engine: Engine, job: Job, start_step: int = 0) -> float:
    """Seconds ``job`` (running) has trained so far, from its own step metric events (those
    copied from earlier attempts are older than its ``started_at``; steps after
    ``start_step``, the step it resumed from): the time from its first logged step to its
    newest, scaled to every step since ``start_step`` (the steps before the first log took as
    long each). With one logged step, the worker's ETA gives the rate. 0.0 before a step."""
    since = job.started_at or 0.0
    points = []
    for ev in events.since(engine, job.id, 0, limit=1_000_000, types=["metric"]):
        step = (ev.data or {}).get("step")
        if ev.ts >= since and isinstance(step, int) and step > start_step:
            points.append((step, ev.ts, ev.data))
    if not points:
        return 0.0
    (s1, t1, _), (sn, tn, data) = points[0], points[-1]
    if sn > s1:
        return max(tn - t1, 0.0) * (sn - start_step) / (sn - s1)
    eta, total = data.get("eta_seconds"), data.get("total_steps")
    if isinstance(eta, (int, float)) and isinstance(total, int) and total > sn:
        return eta * (sn - start_step) / (total - sn)
    return 0.0


def training_time(engine: Engine, job: Job | None) -> dict[str, Any] | None:
    """The run's training time in seconds: ``this_attempt`` (the segments of ``job``, the
    run's current job), ``all_attempts`` (the sum over every segment of the run: the run's
    total) and ``attempts`` (how many segments), rounded to 0.001 s; ``resumed`` when an
    earlier attempt trained too; ``running`` while ``job`` runs (its stretch so far,
    :func:`running_seconds`, is one of the segments: the figures are "so far"). A job trained
    before segments were recorded counts its ``result.train_runtime`` as its one segment. None
    when nothing was trained yet."""
    if job is None:
        return None
    segs = segments(engine, job)
    running = job.state == JobState.RUNNING
    if running and not any(s.get("job_id") == job.id for s in segs):
        start = max((s.get("to_step") for s in segs if isinstance(s.get("to_step"), int)),
                    default=0)
        seconds = running_seconds(engine, job, start)
        if seconds > 0:
            segs.append({"job_id": job.id, "from_step": start, "train_runtime": seconds})
    if not segs:
        runtime = (job.result or {}).get("train_runtime")
        if not isinstance(runtime, (int, float)):
            return None
        segs = [{"job_id": job.id, "train_runtime": runtime}]
    this = sum(s["train_runtime"] for s in segs if s.get("job_id") == job.id)
    total = sum(s["train_runtime"] for s in segs)
    return {"this_attempt": round(this, 3), "all_attempts": round(total, 3),
            "attempts": len(segs), "resumed": len(segs) > 1, "running": running}
