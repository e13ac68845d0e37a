"""``python -m worker.ddp_rank --job ID --worker-id OWNER --comm DIR``: one rank of a
data-parallel job, started by torchrun (:func:`worker.ddp.launch`; ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and the rendezvous come from torchrun's environment).

The rank runs the job's handler with a :class:`RankContext`: rank 0 writes the job's events
(its reporter), the other ranks write nothing; nobody holds the lease (the coordinator does).
Stops come from the coordinator's ``<comm>/stop`` file; after every training step the ranks
agree on the stop with one all-reduce (:meth:`RankContext.step_stop_reason`), so they stop
after the same step. Rank 0 writes the result to ``<comm>/result.json``; a rank that fails
writes its one-line message to ``<comm>/error-rank<r>.txt`` and exits 1 (torchrun then stops
the others); a rank interrupted by a stop exits 0.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from worker import gpu
from worker.context import JobContext, JobError, JobInterrupted
from worker.ddp import read_stop

log = logging.getLogger("worker.ddp_rank")

#: stop reasons in the order one wins over another when ranks see different ones
REASONS = (None, "cancelled", "shutdown", "lost")


class NullReporter:
    """The reporter of ranks > 0: rank 0 alone writes the job's events."""

    def log(self, *a: Any, **k: Any) -> None:
        pass

    def metric(self, **k: Any) -> None:
        pass

    def progress(self, *a: Any, **k: Any) -> None:
        pass

    def sample(self, *a: Any, **k: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def disable(self) -> None:
        pass


class RankContext(JobContext):
    """A rank's job context: the stop flags follow the coordinator's stop file."""

    def __init__(self, *args: Any, rank: int, world_size: int, comm: Path, **kw: Any):
        super().__init__(*args, **kw)
        self.rank, self.world_size, self.comm = rank, world_size, comm

    def _read(self) -> None:
        reason = read_stop(self.comm)
        if reason == "lost":
            self.lost.set()
            self.reporter.disable()
        elif reason == "shutdown":
            self.shutdown.set()
        elif reason == "cancelled":
            self.cancel.set()

    def stop_reason(self) -> str | None:
        """This rank's view of the stop (its own read of the stop file; no collective)."""
        self._read()
        return super().stop_reason()

    def step_stop_reason(self) -> str | None:
        """The stop all ranks agree on after a training step: one all-reduce (max) of every
        rank's :meth:`stop_reason`. Call it at the same point on every rank (the trainer's
        ``on_step_end``)."""
        import torch
        import torch.distributed as dist

        code = REASONS.index(self.stop_reason())
        if not (dist.is_available() and dist.is_initialized()):
            return REASONS[code]
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([code], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        agreed = REASONS[int(t.item())]
        flag = {"lost": self.lost, "shutdown": self.shutdown, "cancelled": self.cancel}.get(
            agreed or "")
        if flag is not None:
            flag.set()  # a rank that had not read the file yet stops for the same reason
        return agreed


def allow_indexed_cpu_locations() -> None:
    """Let ``torch.load`` map storages to ``cpu:<n>``: transformers loads a checkpoint's
    optimizer state with ``map_location=args.device`` whenever there are several ranks, and a
    gloo (CPU) rank's device is ``cpu:0``, which torch does not know as a location."""
    import torch.serialization as ser

    def restore(obj, location: str):
        return obj.cpu() if location.startswith("cpu:") else None

    ser.register_package(5, lambda obj: None, restore)


def _atomic_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, default=str), encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.ddp_rank")
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--comm", required=True)
    args = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with torchrun
    except Exception:  # noqa: BLE001
        pass
    comm = Path(args.comm)
    from app.settings import Settings
    from app.store import queue
    from app.store.db import get_engine
    from worker.child import cap_allocator, is_oom, oom_message
    from worker.loop import handler_for, one_line
    from worker.progress import Reporter

    if gpu.cuda_available():
        gpu._torch().cuda.set_device(local)
    else:
        allow_indexed_cpu_locations()
    settings = Settings()
    engine = get_engine(settings.resolved_database_url)
    job = queue.get_job(engine, args.job)
    if gpu.cuda_available():
        cap_allocator(job, device=local)
    reporter = Reporter(engine, job.id) if rank == 0 else NullReporter()
    ctx = RankContext(engine, settings, job, args.worker_id, reporter, rank=rank,
                      world_size=world, comm=comm)
    try:
        result = handler_for(job.kind)(ctx)
    except JobInterrupted as exc:
        log.info("rank %s stopped (%s)", rank, type(exc).__name__)
        return 0
    except Exception as exc:  # noqa: BLE001 - the coordinator fails the job with this message
        msg = oom_message(job, exc) if is_oom(exc) else (
            str(exc) if isinstance(exc, JobError) else one_line(exc))
        if rank == 0:
            reporter.log(msg, "error", traceback=traceback.format_exc())
        log.error("rank %s failed: %s\n%s", rank, msg, traceback.format_exc())
        (comm / f"error-rank{rank}.txt").write_text(" ".join(msg.split())[:1000],
                                                    encoding="utf-8")
        return 1
    finally:
        reporter.flush()
    if rank == 0:
        _atomic_json(comm / "result.json", result or {})
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
