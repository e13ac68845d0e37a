"""Registry of live worker processes (for ``/healthz``, the UI and run-creation checks)."""
from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store.db import session_scope
from app.store.schema import Worker, now


def register(engine: Engine, worker_id: str, host: str, pid: int, device: str,
             gpu_total_gib: float | None = None, gpu_index: int | None = None,
             gpu_capacity_gib: float | None = None) -> None:
    """Insert or refresh this worker's row; ``gpu_total_gib`` is its GPU's total memory in GiB
    (None for a CPU worker or a lane that runs no GPU jobs). A supervisor's GPU slot also gives
    the device index on its host and ``gpu_capacity_gib``, the GiB jobs may be admitted into
    (total less the reserve)."""
    with session_scope(engine, immediate=True) as s:
        w = s.get(Worker, worker_id) or Worker(id=worker_id, host=host, pid=pid, device=device)
        w.host, w.pid, w.device, w.last_seen = host, pid, device, now()
        w.gpu_total_gib = gpu_total_gib
        w.gpu_index, w.gpu_capacity_gib = gpu_index, gpu_capacity_gib
        s.add(w)


def touch(engine: Engine, worker_id: str, current_job_id: int | None) -> None:
    """Refresh ``last_seen`` and the job the worker is running."""
    with session_scope(engine, immediate=True) as s:
        w = s.get(Worker, worker_id)
        if w is not None:
            w.last_seen, w.current_job_id = now(), current_job_id
            s.add(w)


def unregister(engine: Engine, worker_id: str) -> None:
    """Remove this worker's row (clean shutdown)."""
    with session_scope(engine, immediate=True) as s:
        w = s.get(Worker, worker_id)
        if w is not None:
            s.delete(w)


def has_cuda(w: Worker) -> bool:
    """Whether the worker runs on a CUDA GPU: its ``device`` label (``worker.gpu.device_name``)
    is ``cuda:0 <name>`` on a GPU and ``cpu (...)`` without one."""
    return w.device.startswith("cuda")


def live(engine: Engine, stale_seconds: float) -> list[Worker]:
    """Workers seen within the last ``stale_seconds`` seconds."""
    with session_scope(engine) as s:
        return list(s.exec(select(Worker).where(Worker.last_seen >= now() - stale_seconds)).all())


def largest_gpu_gib(engine: Engine, stale_seconds: float) -> float | None:
    """The largest total GPU memory (GiB) among workers seen within ``stale_seconds`` seconds;
    None when no live worker reports a GPU."""
    sizes = [w.gpu_total_gib for w in live(engine, stale_seconds) if w.gpu_total_gib]
    return max(sizes) if sizes else None


def largest_capacity_gib(engine: Engine, stale_seconds: float,
                         reserve_gib: float) -> tuple[float, float] | None:
    """``(total, capacity)`` GiB of the live GPU with the largest admissible memory: a
    supervisor slot's ``gpu_capacity_gib``, else its total less ``reserve_gib``; None when no
    live worker reports a GPU."""
    best = None
    for w in live(engine, stale_seconds):
        if not w.gpu_total_gib:
            continue
        cap = w.gpu_capacity_gib if w.gpu_capacity_gib is not None \
            else max(0.0, w.gpu_total_gib - reserve_gib)
        if best is None or cap > best[1]:
            best = (w.gpu_total_gib, cap)
    return best


def most_gpus_on_one_host(engine: Engine, stale_seconds: float) -> int:
    """The most live GPU slots (supervisor rows with a ``gpu_capacity_gib``, simulated GPUs
    included) that one host has: how many GPUs one data-parallel run may use. 0 when no live
    worker reports a GPU slot."""
    per_host: dict[str, int] = {}
    for w in live(engine, stale_seconds):
        if w.gpu_capacity_gib is not None:
            per_host[w.host] = per_host.get(w.host, 0) + 1
    return max(per_host.values(), default=0)
