"""A run's training time over all its attempts (a cancelled or failed run resumed is trained in
segments, one per job; each ``trainer.train`` reports only its own).

The worker records each segment as a log event with ``segment = {"job_id", "from_step",
"to_step", "train_runtime"}`` (:func:`worker.jobs.common.record_segment`), and a resumed job
carries the earlier jobs' log events, so the current job's events hold every segment.

A segment is recorded when its attempt ends, so while a job is running its own stretch is
measured from its step metric events (:func:`stretch_seconds`) and counted as one more
segment (``running``); so is an attempt whose process was killed (it could not record its
own; the job was requeued and claimed again: each claim is a ``running`` state event).
"""
from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from app.store import events
from app.store.schema import Job, JobState


def _recorded(engine: Engine, job: Job) -> list[tuple[float, dict[str, Any]]]:
    """(event time, segment) of every segment recorded in ``job``'s events, oldest first."""
    out = []
    for ev in events.since(engine, job.id, 0, limit=1_000_000, types=["log"]):
        seg = (ev.data or {}).get("segment")
        if isinstance(seg, dict) and isinstance(seg.get("train_runtime"), (int, float)):
            out.append((ev.ts, seg))
    return out


def segments(engine: Engine, job: Job) -> list[dict[str, Any]]:
    """The training segments recorded in ``job``'s events, oldest first (see module doc)."""
    return [seg for _, seg in _recorded(engine, job)]


def _attempts(engine: Engine, job: Job) -> list[tuple[float, float | None]]:
    """``[(start, end or None), ...]``: the windows in which ``job``'s own attempts ran, from
    its ``running`` state events (one per claim; a job requeued after its process was killed
    is claimed again); the last window is open. Falls back to ``job.started_at``."""
    starts = sorted(ev.ts for ev in events.since(engine, job.id, 0, limit=1_000_000, types=["state"])
                    if (ev.data or {}).get("state") == JobState.RUNNING)
    if not starts and job.started_at:
        starts = [job.started_at]
    return [(t, starts[i + 1] if i + 1 < len(starts) else None) for i, t in enumerate(starts)]


def stretch_seconds(points: list[tuple[int, float, dict]], start_step: int) -> float:
    """Seconds one attempt trained, from its step metric events ``points`` ((step, time,
    data), oldest first, steps after ``start_step``, the step it resumed from): the time from
    its first logged step to its newest, scaled to every step since ``start_step`` (the steps
    before the first log took as long each). With one logged step, the worker's ETA gives the
    rate. 0.0 before a step."""
    if not points:
        return 0.0
    (s1, t1, _), (sn, tn, data) = points[0], points[-1]
    if sn > s1:
        return max(tn - t1, 0.0) * (sn - start_step) / (sn - s1)
    eta, total = data.get("eta_seconds"), data.get("total_steps")
    if isinstance(eta, (int, float)) and isinstance(total, int) and total > sn:
        return eta * (sn - start_step) / (total - sn)
    return 0.0


def _estimated(job: Job, evs, recorded, window) -> dict[str, Any] | None:
    """The segment of one of ``job``'s attempts (``window``; ``evs`` its metric and log events)
    that recorded none (it is still running, or its
    process was killed: a killed attempt cannot log its own), estimated from that attempt's
    step metric events (:func:`stretch_seconds`); None when it logged no step. Its start step
    is the checkpoint it resumed from (the worker's ``resume_step`` log), else the last
    recorded segment's end before it, at most the step before its first logged one."""
    t0, t1 = window

    def inside(ts: float) -> bool:
        return ts >= t0 and (t1 is None or ts < t1)
    points, resumed = [], None
    for ev in evs:
        data = ev.data or {}
        if not inside(ev.ts):
            continue
        if ev.type == "log" and isinstance(data.get("resume_step"), int):
            resumed = data["resume_step"]
        elif ev.type == "metric" and isinstance(data.get("step"), int):
            points.append((data["step"], ev.ts, data))
    if resumed is None:
        before = [seg.get("to_step") for ts, seg in recorded if ts < t0 and isinstance(seg.get("to_step"), int)]
        resumed = min(max(before, default=0), points[0][0] - 1) if points else 0
    points = [p for p in points if p[0] > resumed]
    seconds = stretch_seconds(points, resumed)
    if seconds <= 0:
        return None
    return {"job_id": job.id, "from_step": resumed, "to_step": points[-1][0],
            "train_runtime": seconds, "estimated": True}


def training_time(engine: Engine, job: Job | None) -> dict[str, Any] | None:
    """The run's training time in seconds: ``all_attempts`` (the sum over every segment of the
    run: its total), ``attempts`` (how many segments: each stretch one process trained, a
    resume's job or a claim of one after a restart) and ``this_attempt`` (the newest segment:
    the one training now, else the last; what the run log's last "trained steps ..." line
    says), rounded to 0.001 s; ``resumed`` when an earlier attempt trained too; ``running``
    while ``job`` (the run's current job) runs (the figures are "so far"). Each of ``job``'s
    own attempts (claims) that recorded no segment (the one running now, or one whose process
    was killed) counts as its step events show (:func:`_estimated`). A job trained before
    segments were recorded counts its ``result.train_runtime`` as its one segment. None when
    nothing was trained yet.

    (Trial s24 M-4: ``this_attempt`` summed every claim of the current job, so after two
    restarts the page read "43 s over all 3 attempts (this attempt 43 s)".)"""
    if job is None:
        return None
    recorded = _recorded(engine, job)
    # (when: a recorded segment's end, an estimated one's start, segment): ordered by when
    # they ran, since a segment's record is written as it ends and a claim starts after the
    # one before it ended
    timed: list[tuple[float, dict[str, Any]]] = list(recorded)
    running = job.state == JobState.RUNNING
    legacy = (job.result or {}).get("train_runtime")
    evs = None  # the job's metric and log events, read once if an attempt needs an estimate
    for window in _attempts(engine, job):
        t0, t1 = window
        if any(seg.get("job_id") == job.id and ts >= t0 and (t1 is None or ts < t1) for ts, seg in recorded):
            continue
        if t1 is None and not running and isinstance(legacy, (int, float)):
            continue  # finished before segments were recorded: its result's runtime, below
        if evs is None:
            evs = events.since(engine, job.id, 0, limit=1_000_000, types=["metric", "log"])
        est = _estimated(job, evs, recorded, window)
        if est is not None:
            timed.append((t0, est))
    if not any(seg.get("job_id") == job.id for _, seg in timed) and isinstance(legacy, (int, float)):
        timed.append((float("inf"), {"job_id": job.id, "train_runtime": legacy}))
    if not timed:
        return None
    timed.sort(key=lambda x: x[0])
    total = sum(seg["train_runtime"] for _, seg in timed)
    return {"this_attempt": round(timed[-1][1]["train_runtime"], 3),
            "all_attempts": round(total, 3), "attempts": len(timed),
            "resumed": len(timed) > 1, "running": running}
