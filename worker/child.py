"""``python -m worker.child --job ID --lease-owner OWNER``: run one job a supervisor admitted
(worker/supervisor.py), in this process, then exit (its GPU memory goes with it).

The supervisor's claim leased the job to ``OWNER``; this process heartbeats, watches cancel and
ends the job fenced under that owner exactly as a worker does (:meth:`worker.loop.Worker.run_job`).
On a GPU the allocator is capped at the admitted memory (``jobs.admitted_gib`` less the CUDA
context), so a job that outgrows its admission fails itself instead of its neighbours. Running out
of memory fails the job with its estimate, admitted memory, measured peak and what to lower.
The child gets SIGTERM when the supervisor dies (Linux ``PR_SET_PDEATHSIG``): its job is handed
back to the queue as on any shutdown.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from app.settings import Settings
from app.store import queue
from app.store.db import get_engine
from worker import gpu
from worker.context import JobContext, JobError
from worker.loop import HANDLERS, Worker

log = logging.getLogger("worker.child")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is running out of GPU memory (``torch.OutOfMemoryError`` /
    ``torch.cuda.OutOfMemoryError``, or a CUDA/cuBLAS allocation failure)."""
    text = str(exc)
    return (type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in text
            or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def oom_message(job, exc: BaseException) -> str:
    """The failure of a job that ran out of memory: its estimate and admission (GiB), the peak
    measured in this process, and what to lower."""
    peak, kind = gpu.peak_memory_gib()
    where = f"GPU {job.gpu_index}" if job.gpu_index is not None else "its device"
    est = f"{job.estimate_gib:.1f} GiB" if job.estimate_gib is not None else "unknown"
    admitted = f"{job.admitted_gib:.1f} GiB" if job.admitted_gib is not None else "the whole GPU"
    detail = " ".join(str(exc).split())[:200]
    return (f"out of GPU memory on {where}: estimate {est}, admitted with {admitted}, measured "
            f"peak {peak:.1f} GiB ({'allocator' if kind == 'gpu' else 'process RSS'}). Lower "
            "per_device_train_batch_size or max_seq_length (GRPO: num_generations or "
            "max_completion_length), set load_in_4bit, or set a lower vram_budget_gib; the "
            f"other jobs on this GPU kept running. ({detail})")


class JobProcess(Worker):
    """A worker that runs the one job it was given (no claim loop, no worker row)."""

    def _call_handler(self, ctx: JobContext) -> dict[str, Any] | None:
        try:
            return super()._call_handler(ctx)
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is reworded
            if is_oom(exc):
                raise JobError(oom_message(ctx.job, exc)) from exc
            raise


def cap_allocator(job, device: int = 0) -> None:
    """On a GPU: let this process allocate at most its admitted memory less the CUDA context
    on CUDA ``device`` (a data-parallel rank: its own GPU; ``admitted_gib`` is per GPU)."""
    if job.admitted_gib is None or os.environ.get("CUDA_VISIBLE_DEVICES") == "" \
            or not gpu.cuda_available():
        return
    from app.studio.estimate import CUDA_CONTEXT_GIB

    total = gpu.total_gib()
    if total:
        frac = min(1.0, max(0.05, (job.admitted_gib - CUDA_CONTEXT_GIB) / total))
        gpu._torch().cuda.set_per_process_memory_fraction(frac, device)
        log.info("job %s: allocator capped at %.1f GiB (%.3f of %.1f GiB)", job.id,
                 frac * total, frac, total)


def _memory_history(job):
    """A debugging aid for the estimator: with ``WHETSTONE_CUDA_MEMORY_HISTORY=DIR`` on a GPU,
    record every CUDA allocation of this job with its stack (torch.cuda.memory's history) and
    return a function that writes the snapshot to ``DIR/job-<id>-<kind>.pickle`` (open it at
    https://pytorch.org/memory_viz, or read its ``device_traces``). Otherwise a no-op."""
    where = os.environ.get("WHETSTONE_CUDA_MEMORY_HISTORY")
    if not where or not gpu.cuda_available():
        return lambda: None
    torch = gpu._torch()
    torch.cuda.memory._record_memory_history(max_entries=200_000)

    def dump() -> None:
        os.makedirs(where, exist_ok=True)
        path = os.path.join(where, f"job-{job.id}-{job.kind}.pickle")
        torch.cuda.memory._dump_snapshot(path + ".tmp")
        os.replace(path + ".tmp", path)
        torch.cuda.memory._record_memory_history(enabled=None)
        log.info("job %s: CUDA memory history in %s", job.id, path)
    return dump


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the lease still fences a stray child
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.child")
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--lease-owner", required=True)
    p.add_argument("--handlers", default="", help="JSON kind -> module:function (the supervisor's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    if args.handlers:
        HANDLERS.update(json.loads(args.handlers))
    settings = Settings()
    engine = get_engine(settings.resolved_database_url)
    job = queue.get_job(engine, args.job)
    if job.state != "running" or job.lease_owner != args.lease_owner:
        log.warning("job %s is no longer ours (%s, %s); exiting", job.id, job.state,
                    job.lease_owner)
        return 0
    w = JobProcess(settings, worker_id=args.lease_owner, kinds=[job.kind])
    w.engine = engine
    first: dict[str, float | None] = {"at": None}

    def on_signal(signum, _frame):  # noqa: ANN001 - as worker/__main__.py: twice interrupts
        if first["at"] is None:
            first["at"] = time.monotonic()
            w.request_shutdown()
        elif time.monotonic() - first["at"] > 2.0:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    gpu.cuda_available()  # import torch inside the admission's start allowance, not the lease
    if "," not in (job.gpu_slot or ""):  # a data-parallel job: each rank caps its own GPU
        cap_allocator(job)
    history = _memory_history(job)
    try:
        w.run_job(job)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        history()
    from worker import notify

    notify.wait()  # a run's webhook POST, sent after the job's end was recorded
    return 0


if __name__ == "__main__":
    sys.exit(main())
