"""Data-parallel training: one run on several GPUs of one host through torchrun.

A training job whose spec asks for ``num_gpus`` N > 1 is run by its job process (a supervisor's
child, admitted onto N GPU slots at once; or a plain worker that sees N GPUs) as a
*coordinator*: :func:`launch` starts ``python -m torch.distributed.run --standalone
--nproc-per-node N -m worker.ddp_rank`` (a standalone c10d rendezvous on a free localhost port)
and waits for it. Each rank (:mod:`worker.ddp_rank`) runs the same job handler
(:mod:`worker.jobs.train`) on its shard of every batch: transformers' Trainer wraps the LoRA
model in DistributedDataParallel (NCCL on GPUs, gloo on the CPU), so the LoRA gradients are
all-reduced every optimizer step. Rank 0 alone writes events, checkpoints and the adapter.

The coordinator keeps what a job process always does: the lease heartbeat, the cancel flag and
fencing (:meth:`worker.loop.Worker.run_job`). It hands a stop to the ranks through a file,
``<comm>/stop`` (``cancelled`` | ``shutdown`` | ``lost``); every rank reads it and they agree
on it with one all-reduce after every step (:meth:`worker.ddp_rank.RankContext.step_stop_reason`),
so all ranks stop after the same step (saving one checkpoint on cancel and shutdown). Ranks
that have not stopped :data:`STOP_GRACE_SECONDS` after the stop was written are terminated.

A rank that fails or dies makes torchrun stop the others and exit non-zero; the job fails with
the rank's own message (``<comm>/error-rank<r>.txt``) or, for a rank killed by a signal, the
rank, its exit code and the signal (torchrun's failure summary, in ``<comm>/torchrun.log``).
When the coordinator exits, every slot of the job is free.

Environment of the ranks: ``NCCL_NVLS_ENABLE=0`` (NVLink multicast off, as the GPU hosts
require), ``CUDA_VISIBLE_DEVICES`` as given to the job process (rank r uses its r-th GPU).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from worker import gpu
from worker.checkpoints import newest_complete
from worker.context import JobContext, JobError

#: Seconds the ranks get, once a stop is written, to finish their step, checkpoint and exit.
STOP_GRACE_SECONDS = 90.0
#: Seconds between two looks at the ranks and the stop flags.
POLL_SECONDS = 0.2
#: Environment every rank gets (NVLink multicast off: the GPU hosts require it).
RANK_ENV = {"NCCL_NVLS_ENABLE": "0"}


def in_rank() -> bool:
    """Whether this process is a rank that torchrun started (``WORLD_SIZE`` set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ


def world_size() -> int:
    """The number of ranks of this process's group (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if in_rank() else 1


def is_main(ctx: JobContext) -> bool:
    """Whether ``ctx`` writes the job's records: the only process of a 1-GPU job, or rank 0."""
    return getattr(ctx, "rank", 0) == 0


def wants_launch(spec) -> bool:
    """Whether the job process must launch ranks for ``spec`` (``num_gpus`` > 1, not a rank)."""
    return getattr(spec, "num_gpus", 1) > 1 and not in_rank()


def comm_dir(ctx: JobContext, run_id: str) -> Path:
    """The folder the coordinator and the ranks of this job exchange files through."""
    return (ctx.settings.data_dir / "runs" / run_id / f".ddp-job{ctx.job.id}").resolve()


def command(n: int, job_id: int, worker_id: str, comm: Path) -> list[str]:
    """The torchrun command line for ``n`` ranks of job ``job_id``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(n), "--max-restarts", "0", "--monitor-interval", "0.2",
            "-m", "worker.ddp_rank", "--job", str(job_id), "--worker-id", worker_id,
            "--comm", str(comm)]


def _prctl_pdeathsig() -> None:  # runs in the torchrun process before exec
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the job
    except Exception:  # noqa: BLE001
        pass


def launch(ctx: JobContext, run_id: str, spec) -> dict[str, Any]:
    """Run the job on ``spec.num_gpus`` ranks and return rank 0's result (see the module
    docstring). Raises JobError when this process sees too few GPUs or a rank fails; the
    stop flags raise their interrupt (:meth:`JobContext.check`) once the ranks are down."""
    n = spec.num_gpus
    if gpu.cuda_available():
        have = gpu._torch().cuda.device_count()
        if have < n:
            raise JobError(f"num_gpus {n}: this job process sees {have} GPU(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        backend = "NCCL"
    else:
        backend = "gloo on the CPU"
    comm = comm_dir(ctx, run_id)
    shutil.rmtree(comm, ignore_errors=True)
    comm.mkdir(parents=True)
    # incomplete checkpoints are set aside here, once, not by every rank at the same time
    newest_complete(comm.parent / "checkpoints", on_skip=lambda msg: ctx.log(msg, "warning"))
    env = {**os.environ, **RANK_ENV,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           # the ranks read the store this process was given (not only its environment)
           "WHETSTONE_DATA_DIR": str(ctx.settings.data_dir),
           "WHETSTONE_DATABASE_URL": ctx.settings.resolved_database_url}
    ctx.log(f"data-parallel run on {n} {'GPUs' if backend == 'NCCL' else 'CPU ranks'} "
            f"(torchrun, {backend}): each rank runs {spec.gradient_accumulation_steps // n} "
            f"of the {spec.gradient_accumulation_steps} micro-batches of every step")
    log_file = (comm / "torchrun.log").open("wb")
    # its own session: a terminal's Ctrl-C reaches the job process, which stops the ranks
    # after a step (with a checkpoint); torchrun itself would kill them mid-step
    proc = subprocess.Popen(command(n, ctx.job.id, ctx.worker_id, comm), env=env,
                            stdout=log_file, stderr=subprocess.STDOUT,
                            preexec_fn=_prctl_pdeathsig, start_new_session=True)
    stop_at: float | None = None
    try:
        while proc.poll() is None:
            ctx.poll_cancel()  # at most every CANCEL_POLL_SECONDS: a cancel within a step or two
            reason = ctx.stop_reason()
            if reason and stop_at is None:
                write_stop(comm, reason)
                stop_at = time.monotonic()
            if stop_at is not None and time.monotonic() - stop_at > STOP_GRACE_SECONDS:
                ctx.log(f"the ranks did not stop within {STOP_GRACE_SECONDS:.0f} s; "
                        "terminating them", "warning")
                terminate(proc)
            try:
                proc.wait(POLL_SECONDS)
            except subprocess.TimeoutExpired:
                pass
    finally:  # an interrupt (lease lost) or an error here: the ranks go down with the job
        if proc.poll() is None:
            write_stop(comm, ctx.stop_reason() or "lost")
            terminate(proc)
        log_file.close()
    if proc.returncode == 0 and (comm / "result.json").is_file():
        ctx.cancel_moot = True  # the ranks finished training (rank 0 told of a late cancel)
    ctx.check()  # cancelled / shutdown / lost: the ranks stopped for it
    if proc.returncode != 0:
        raise JobError(failure(comm, n, proc.returncode))
    result_path = comm / "result.json"
    if not result_path.is_file():
        raise JobError(f"the {n} ranks exited without a result (see {comm / 'torchrun.log'})")
    result = json.loads(result_path.read_text(encoding="utf-8"))
    result["num_gpus"] = n
    shutil.rmtree(comm, ignore_errors=True)  # kept only when the ranks failed (its log)
    return result


def write_stop(comm: Path, reason: str) -> None:
    """Tell the ranks to stop (``cancelled`` | ``shutdown`` | ``lost``), atomically."""
    tmp = comm / ".stop.tmp"
    tmp.write_text(reason, encoding="utf-8")
    os.replace(tmp, comm / "stop")


def read_stop(comm: Path) -> str | None:
    """The stop reason the coordinator wrote, or None."""
    try:
        return (comm / "stop").read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


def terminate(proc: subprocess.Popen, wait: float = 15.0) -> None:
    """SIGTERM torchrun (its agent stops every rank), SIGKILL it after ``wait`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


_ROOT = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def failure(comm: Path, n: int, returncode: int) -> str:
    """The job's error after the ranks failed. A rank killed by a signal (the root cause torchrun
    names in its summary, with a negative exit code) is named with the signal: the errors of the
    other ranks (a broken connection to it) are its consequence. Otherwise the first message a
    rank wrote (the root cause's own, when it wrote one)."""
    text = ""
    try:
        text = (comm / "torchrun.log").read_text(encoding="utf-8", errors="replace")
    except OSError:
        pass
    found = _ROOT.search(text[text.rfind("Root Cause"):]) if "Root Cause" in text else None
    root, code = (int(found.group(1)), int(found.group(2))) if found else (None, None)
    if code is not None and code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = f"signal {-code}"
        return (f"rank {root} of {n} died (exit code {code}, killed by {sig}); torchrun stopped "
                f"the other ranks and the job's {n} GPU slots are free again")
    errors = sorted(comm.glob("error-rank*.txt"), key=lambda p: p.stat().st_mtime)
    own = [p for p in errors if p.stem == f"error-rank{root}"]
    if own or errors:
        first = (own or errors)[0]
        rank = first.stem.removeprefix("error-rank")
        return f"rank {rank} of {n}: {first.read_text(encoding='utf-8').strip()}"
    if root is not None:
        return f"rank {root} of {n} exited with code {code}; see {comm / 'torchrun.log'}"
    return f"the {n} ranks failed (torchrun exit code {returncode}); see {comm / 'torchrun.log'}"
