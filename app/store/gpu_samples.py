"""GPU samples: what each supervisor measured on its GPUs (utilisation %, memory GiB,
temperature °C, power W, running jobs), written every few seconds and kept for two hours.

Written by worker/gpu_samples.py, read by the GPU dashboard (app/studio/gpu_view.py). No torch,
no NVML here: rows in, rows out.
"""
from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store.db import session_scope
from app.store.schema import GpuSample, now

#: Samples older than this many seconds are deleted when new ones are written (two hours).
KEEP_SECONDS = 2 * 3600.0


def record(engine: Engine, samples: Iterable[GpuSample],
           keep_seconds: float = KEEP_SECONDS) -> int:
    """Insert ``samples`` and delete every sample older than ``keep_seconds`` seconds (any
    host's: the table holds a window, not a history). Returns how many were deleted."""
    with session_scope(engine, immediate=True) as s:
        for sample in samples:
            s.add(sample)
        gone = s.execute(delete(GpuSample).where(GpuSample.ts < now() - keep_seconds))
        return gone.rowcount or 0


def since(engine: Engine, t: float) -> list[GpuSample]:
    """Every sample taken at or after epoch second ``t``, oldest first, by slot."""
    with session_scope(engine) as s:
        return list(s.exec(select(GpuSample).where(GpuSample.ts >= t)
                           .order_by(GpuSample.slot, GpuSample.ts, GpuSample.id)).all())


def latest(engine: Engine, slot: str) -> GpuSample | None:
    """The newest sample of ``slot`` (a GPU slot's worker row id), or None."""
    with session_scope(engine) as s:
        return s.exec(select(GpuSample).where(GpuSample.slot == slot)
                      .order_by(GpuSample.ts.desc(), GpuSample.id.desc()).limit(1)).first()
