"""Fairness and limits: per-user quotas and fair-share weights (set by an admin), moving a job
to the front of the queue, and GPU-hours per user and per run (with a CSV for the admin).

Admission itself (what the quotas and weights do) is :mod:`app.store.admission`; GPU time is
(finished or now) - started of every job that ran on a GPU, one GPU a job.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from functools import partial

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store import queue
from app.store.admission import gpu_seconds
from app.store.db import session_scope
from app.store.schema import Job, Run, User, now
from app.studio import access, accounts, audit
from app.studio.errors import StudioError, collect, invalid

#: Each quota field as the Admin page's quota table names its column; a refusal names the field
#: by this label (the error's ``field`` stays the key).
LABELS = {"quota_jobs": "Jobs at once", "quota_gib": "GPU memory at once (GiB)",
          "quota_gpu_hours": "GPU-hours a day", "share_weight": "Weight"}
#: What an empty field means, as a refusal says it: no limit for a quota; the default weight.
EMPTY = {"share_weight": "empty: the default, 1"}


def _empty(field: str) -> str:
    """``(empty: ...)``: what leaving ``field`` empty means (:data:`EMPTY`, else no limit)."""
    return f"({EMPTY.get(field, 'empty: no limit')})"


def _number(field: str, raw: str | float | int | None, kind: type, minimum: float) -> float | None:
    """A quota field: empty/None = no limit (the weight: its default, 1); else a ``kind``
    number >= ``minimum``. Raises StudioError invalid on ``field``, worded with its
    :data:`LABELS` label and what leaving it empty means (:func:`_empty`)."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    label = LABELS[field]
    if kind is int:
        return _whole(field, raw, minimum)
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise invalid(field, f"{label} must be a number {_empty(field)}") from None
    if not math.isfinite(value):  # "NaN", "1e999" (inf)
        raise invalid(field, f"{label} must be a finite number {_empty(field)}")
    if value < minimum:
        raise invalid(field, f"{label} must be at least {minimum:g}")
    if value > 1e9:
        raise invalid(field, f"{label} must be at most 1000000000 {_empty(field)}")
    return value


def _whole(field: str, raw: str | float | int, minimum: float) -> int:
    """A whole-number quota field (``quota_jobs``): ``"2"``, also ``"2.0"`` and ``"1e3"`` (whole
    values written as decimals); ``"1.5"``, ``"abc"``, ``"nan"`` are refused as not whole.
    Raises StudioError invalid on ``field``, worded with its :data:`LABELS` label."""
    label = LABELS[field]
    try:
        value = int(raw)
    except (TypeError, ValueError):
        try:
            number = float(raw)
        except (TypeError, ValueError):
            number = math.nan
        if not (math.isfinite(number) and number.is_integer()):
            shown = str(raw).strip()
            shown = shown if len(shown) <= 20 else shown[:20] + "…"
            raise invalid(field, f"{label} must be a whole number, {minimum:g} or more "
                          f"{_empty(field)}, not {shown}") from None
        value = int(number)
    if value < minimum:
        raise invalid(field, f"{label} must be at least {minimum:g}")
    if value > 1e9:
        raise invalid(field, f"{label} must be at most 1000000000 {_empty(field)}")
    return value


def set_quota(engine: Engine, actor: User, user_id: str, *, jobs=None, gib=None,
              gpu_hours=None, weight=1.0) -> User:
    """Set ``user_id``'s quotas (admin only): ``jobs`` GPU jobs running at once, ``gib`` GiB of
    GPU memory admitted at once, ``gpu_hours`` GPU-hours in the last 24 h (each None or empty =
    no limit) and the fair-share ``weight`` (> 0; 2 = entitled to twice the GPU time of a 1).

    Raises: StudioError forbidden, not_found, invalid (:class:`~app.studio.errors.FieldErrors`
    naming every bad field of ``quota_jobs``, ``quota_gib``, ``quota_gpu_hours`` and
    ``share_weight`` at once)."""
    access.require_admin(actor)
    asked = {"quota_jobs": (jobs, int, 0), "quota_gib": (gib, float, 0),
             "quota_gpu_hours": (gpu_hours, float, 0), "share_weight": (weight, float, 0.01)}
    fields = dict(zip(asked, collect(*(partial(_number, name, *how)
                                       for name, how in asked.items()))))
    if fields["share_weight"] is None:
        fields["share_weight"] = 1.0
    user = accounts._update_user(engine, user_id, **fields)  # raises not_found
    audit.record(engine, actor.id, "user.quota_changed", "user", user_id, **fields)
    return user


def move_to_front(engine: Engine, actor: User, job_id: int) -> Job:
    """Put a queued job first in admission order (admin only; its owner's quotas still apply).

    Raises: StudioError forbidden, not_found, conflict (the job is not waiting)."""
    access.require_admin(actor)
    job = access.job(engine, actor, job_id)
    if job.state != "queued":
        raise StudioError("conflict", f"job {job_id} is {job.state}, not waiting")
    job = queue.move_to_front(engine, job_id)
    audit.record(engine, actor.id, "job.moved_to_front", "job", str(job_id))
    return job


@dataclass(frozen=True)
class RunUsage:
    """GPU time of one job (a run's training job, or another GPU job), hours."""

    job_id: int
    run_id: str | None
    owner: str | None
    owner_name: str
    kind: str
    state: str
    gpu: str | None
    started_at: float | None
    finished_at: float | None
    gpu_hours: float


def usage(engine: Engine, actor: User, days: float = 30.0) -> tuple[list[RunUsage], dict[str, float]]:
    """GPU-hours in the last ``days`` days (admin only): one row per job that ran on a GPU
    (newest first) and the total per user name.

    Raises: StudioError forbidden."""
    access.require_admin(actor)
    t = now()
    start = t - days * 86400.0
    with session_scope(engine) as s:
        jobs = s.exec(select(Job).where(Job.gpu_index.is_not(None), Job.started_at.is_not(None))
                      .order_by(Job.id.desc())).all()
        names = {u.id: u.name for u in s.exec(select(User)).all()}
        run_ids = {j.run_id for j in jobs if j.run_id}
        runs = {r.id: r for r in s.exec(select(Run).where(Run.id.in_(run_ids)))} if run_ids else {}
    rows: list[RunUsage] = []
    per_user: dict[str, float] = {}
    for j in jobs:
        hours = gpu_seconds(j, start, t) / 3600.0
        if hours <= 0:
            continue
        owner = runs[j.run_id].owner if j.run_id in runs else j.owner
        name = names.get(owner, owner or "nobody")
        rows.append(RunUsage(j.id, j.run_id, owner, name, j.kind, j.state, j.gpu_slot,
                             j.started_at, j.finished_at, round(hours, 4)))
        per_user[name] = round(per_user.get(name, 0.0) + hours, 4)
    return rows, per_user


def gpu_hours_note(engine: Engine, stale_seconds: float) -> str | None:
    """What the Admin page says under its GPU-hours table on a box whose live workers have no
    GPU slot (only CPU slots): jobs there run on the CPU, GPU-hours count GPU time only, so the
    table stays empty and a GPU-hours quota never applies. None when a GPU slot is live, or no
    worker is (nothing tells)."""
    from app.store import workers
    from app.studio.worker_view import any_gpu

    if any_gpu(workers.live(engine, stale_seconds)) is not False:
        return None
    return ("This box has no GPU: its jobs run on the CPU slot, and GPU-hours count GPU time "
            "only, so this table stays empty and a GPU-hours quota (GPU-hours a day) never "
            "applies here.")


def usage_csv(engine: Engine, actor: User, days: float = 30.0) -> str:
    """:func:`usage` as CSV text (admin only): ``job_id, run_id, user, kind, state, gpu,
    started_at, finished_at`` (UTC epoch seconds) and ``gpu_hours``.

    Raises: StudioError forbidden."""
    rows, _ = usage(engine, actor, days)
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["job_id", "run_id", "user", "kind", "state", "gpu", "started_at", "finished_at",
                "gpu_hours"])
    for r in rows:
        w.writerow([r.job_id, r.run_id or "", r.owner_name, r.kind, r.state, r.gpu or "",
                    f"{r.started_at:.0f}" if r.started_at else "",
                    f"{r.finished_at:.0f}" if r.finished_at else "", f"{r.gpu_hours:.4f}"])
    return out.getvalue()
