"""The GPU dashboard (``/gpus``, ``/api/gpus``): per GPU the newest figures its supervisor
sampled (utilisation %, memory used/total GiB, temperature °C, power W), the jobs running there,
and the last hour of samples for the charts.

The figures come from ``gpu_samples`` (written by worker/gpu_samples.py; the web never touches
NVML or torch). The GPUs are the live supervisor slots plus any slot sampled within the window
(a stopped supervisor's GPU stays on the page, marked not live, until its samples age out). The
running jobs are read from the queue: a member sees their own in full and other users' as
anonymous jobs (admitted memory only); an admin sees everything.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.settings import Settings
from app.store import admission, gpu_samples, workers
from app.store.db import session_scope
from app.store.schema import GpuSample, Job, JobState, Run, User, now
from app.studio import access, worker_view

if TYPE_CHECKING:
    from app.store.schema import User as Actor

#: The charts' window (seconds) and the most points a chart line gets (older samples are thinned).
WINDOW_SECONDS = 3600.0
MAX_POINTS = 360
FIGURES = ("util_pct", "mem_used_gib", "mem_total_gib", "temp_c", "power_w")


def _thin(rows: list[GpuSample], most: int) -> list[GpuSample]:
    """Every k-th sample so that at most ``most`` remain, always keeping the newest."""
    if len(rows) <= most:
        return rows
    step = math.ceil(len(rows) / most)
    kept = rows[-1::-step][::-1]
    return kept[-most:]


def _jobs(engine: Engine, actor: Actor) -> dict[str, list[dict[str, Any]]]:
    """Running jobs with a GPU slot, per slot id, as ``actor`` may see them."""
    with session_scope(engine) as s:
        jobs = list(s.exec(select(Job).where(Job.state == JobState.RUNNING,
                                             Job.gpu_slot.is_not(None)).order_by(Job.id)).all())
        run_ids = {j.run_id for j in jobs if j.run_id}
        runs = {r.id: r for r in s.exec(select(Run).where(Run.id.in_(run_ids)))} \
            if run_ids else {}
        owner_ids = {runs[j.run_id].owner if j.run_id in runs else j.owner for j in jobs}
        names = {u.id: u.name for u in s.exec(select(User).where(User.id.in_(owner_ids)))} \
            if owner_ids else {}
    out: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        run = runs.get(j.run_id)
        owner = run.owner if run is not None else j.owner
        admitted = None if j.admitted_gib is None else round(j.admitted_gib, 2)
        if access.can_see(actor, owner):
            row = {"visible": True, "job_id": j.id, "run_id": j.run_id,
                   "run_name": run.name if run is not None else None, "kind": j.kind,
                   "owner": names.get(owner, owner), "admitted_gib": admitted,
                   "estimate_gib": j.estimate_gib, "started_at": j.started_at}
        else:
            row = {"visible": False, "job_id": None, "run_id": None, "run_name": None,
                   "kind": None, "owner": None, "admitted_gib": admitted,
                   "estimate_gib": None, "started_at": None}
        for slot_id in admission.slot_ids(j):  # a data-parallel job is on each of its GPUs
            out.setdefault(slot_id, []).append(row)
    return out


def dashboard(engine: Engine, settings: Settings, actor: Actor,
              window_seconds: float = WINDOW_SECONDS, max_points: int = MAX_POINTS
              ) -> dict[str, Any]:
    """The dashboard as JSON-ready data: ``{"gpus": [...], "window_seconds", "sample_seconds",
    "now"}``. Each GPU has ``id`` (its slot), ``host``, ``index``, ``name``, ``source``
    (nvml | simulated | cpu), ``live``, ``role`` (``gpu_slot`` | ``cpu_slot``), ``supervisor``
    (the id of the supervisor whose slot it is), ``capacity_gib``, ``current`` (the newest sample's
    figures and its ``ts``/``age_seconds``, or None before the first sample), ``jobs`` (see the
    module docstring) and ``history``: parallel lists ``ts`` (epoch seconds) and one per figure
    (None where unknown), plus ``jobs``, the number of jobs running at each sample.
    Units: GiB, percent, °C, W, seconds."""
    t = now()
    live = {w.id: w for w in workers.live(engine, settings.worker_stale_seconds)}
    slots = {sl.id: sl for sl in admission.slots_of(list(live.values()))}
    by_slot: dict[str, list[GpuSample]] = {}
    for row in gpu_samples.since(engine, t - window_seconds):
        by_slot.setdefault(row.slot, []).append(row)
    running = _jobs(engine, actor)
    of = {p.id: g.id for g in worker_view.worker_groups(list(live.values()))
          for p in g.parts}
    gpus = []
    for sid in set(slots) | set(by_slot):
        rows, slot = by_slot.get(sid, []), slots.get(sid)
        last = rows[-1] if rows else None
        shown = _thin(rows, max_points)
        index = slot.index if slot else last.gpu_index
        gpus.append({
            "id": sid,
            "host": slot.host if slot else last.host,
            "index": index,
            "name": (last.name if last else "") or (live[sid].device if sid in live else sid),
            "source": last.source if last else None,
            "live": sid in slots,
            "role": "gpu_slot" if index is not None else "cpu_slot",
            "supervisor": of.get(sid, sid.rsplit("-", 1)[0]),
            "capacity_gib": slot.capacity_gib if slot else None,
            "current": None if last is None else {
                "ts": last.ts, "age_seconds": round(max(0.0, t - last.ts), 1),
                **{k: getattr(last, k) for k in FIGURES}},
            "jobs": running.get(sid, []),
            "history": {"ts": [r.ts for r in shown],
                        **{k: [getattr(r, k) for r in shown] for k in FIGURES},
                        "jobs": [len(r.jobs or []) for r in shown]},
        })
    gpus.sort(key=lambda g: (g["host"] or "", g["index"] if g["index"] is not None else 1 << 30,
                             g["id"]))
    return {"gpus": gpus, "window_seconds": window_seconds,
            "sample_seconds": settings.gpu_sample_seconds, "now": t}


def chart_series(data: dict[str, Any]) -> dict[str, Any]:
    """What the page's charts draw (static/gpus.js): per GPU its label and, per figure, the
    points ``{"x": minutes before now (<= 0), "y": value}`` with unknown values left out;
    ``window_minutes`` is the x axis' extent."""
    out = []
    for g in data["gpus"]:
        h = g["history"]
        label = f"{g['host']} GPU {g['index']}" if g["index"] is not None else f"{g['host']} CPU"
        out.append({"id": g["id"], "label": label, **{
            k: [{"x": round((ts - data["now"]) / 60.0, 3), "y": v}
                for ts, v in zip(h["ts"], h[k]) if v is not None]
            for k in ("util_pct", "mem_used_gib", "temp_c", "power_w")}})
    return {"gpus": out, "window_minutes": data["window_seconds"] / 60.0}
