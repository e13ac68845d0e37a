"""The worker loop: claim a job, dispatch on ``job.kind``, end it fenced; repeat.

* At start: migrate the database, register the worker, reap expired leases and the jobs a
  previous process with this worker id died holding, seed the demo model.
* Every ``settings.reap_interval_seconds``: reap again (another worker may have died).
* A handler that raises fails its job with a one-line message (the traceback goes into a
  ``log`` event) and the worker keeps serving.
* Cancel (seen by the lease thread) -> the handler stops at its next check -> ``cancelled``.
* SIGTERM/SIGINT -> the handler stops at its next check (training saves a checkpoint) -> the
  job is released back to ``queued`` -> the worker unregisters and exits 0.
"""
from __future__ import annotations

import importlib
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from app.settings import Settings
from app.store import queue, workers
from app.store.db import get_engine
from app.store.schema import Job
from worker import gpu
from worker.context import (JobCancelled, JobContext, JobError, LeaseLost, WorkerShutdown)
from worker.lease import LeaseKeeper
from worker.progress import Reporter

log = logging.getLogger("worker")

#: job kind -> "module:function" taking a JobContext and returning the result dict.
HANDLERS: dict[str, str] = {
    "import_model": "worker.jobs.import_model:run",
    "train": "worker.jobs.train:run",
    "grpo": "worker.jobs.grpo:run",
    "export": "worker.jobs.export:run",
}


def handler_for(kind: str) -> Callable[[JobContext], dict[str, Any] | None]:
    """Import the handler of a job kind. Raises JobError for an unknown kind."""
    target = HANDLERS.get(kind)
    if target is None:
        raise JobError(f"this worker has no handler for job kind {kind!r} "
                       f"(known: {', '.join(sorted(HANDLERS))})")
    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)


def one_line(exc: BaseException) -> str:
    """A clear single-line message for a failed job."""
    text = " ".join(str(exc).split()) or "(no message)"
    if not isinstance(exc, JobError):
        text = f"{type(exc).__name__}: {text}"
    return text[:1000]


class Worker:
    """One worker process (one GPU, or the CPU)."""

    def __init__(self, settings: Settings, worker_id: str | None = None,
                 kinds: list[str] | None = None, poll_interval: float = 1.0):
        self.settings = settings
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.kinds = kinds or sorted(HANDLERS)
        self.poll_interval = poll_interval
        self.shutdown = threading.Event()
        self.engine = None
        self.current: JobContext | None = None
        self._last_reap = 0.0

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Migrate, register, reap, seed the demo model."""
        from app.store import migrate

        self.settings.ensure_dirs()
        url = self.settings.resolved_database_url
        migrate.upgrade(url)
        self.engine = get_engine(url)
        workers.register(self.engine, self.worker_id, socket.gethostname(), os.getpid(),
                         gpu.device_name())
        self.reap(restarted=True)
        try:
            from app.store.seed import ensure_demo_model

            ensure_demo_model(self.engine, self.settings)
        except Exception:  # noqa: BLE001 - the demo model is a convenience, never fatal
            log.exception("could not register the demo model")
        log.info("worker %s ready on %s (kinds: %s)", self.worker_id, gpu.device_name(),
                 ", ".join(self.kinds))

    def stop(self) -> None:
        """Unregister (called on exit)."""
        if self.engine is not None:
            try:
                workers.unregister(self.engine, self.worker_id)
            except Exception:  # noqa: BLE001
                log.exception("could not unregister worker %s", self.worker_id)

    def request_shutdown(self) -> None:
        """Signal handler body: stop the current job at its next check and leave the loop."""
        self.shutdown.set()

    def reap(self, restarted: bool = False) -> None:
        """Requeue or fail jobs whose lease expired; at start (``restarted``) also the jobs still
        leased to this worker id, whose previous process died holding them."""
        self._last_reap = time.monotonic()
        for job_id, state in queue.reap(self.engine, self.worker_id if restarted else None):
            log.warning("reaped job %s -> %s", job_id, state)

    # ---- the loop ------------------------------------------------------------------------
    def serve(self, once: bool = False) -> int:
        """Claim and run jobs until shutdown (or after one job with ``once``). Returns 0."""
        while not self.shutdown.is_set():
            if time.monotonic() - self._last_reap >= self.settings.reap_interval_seconds:
                self.reap()
            job = queue.claim(self.engine, self.worker_id, self.settings.lease_seconds, self.kinds)
            if job is None:
                workers.touch(self.engine, self.worker_id, None)
                self.shutdown.wait(self.poll_interval)
                continue
            self.run_job(job)
            if once:
                break
        return 0

    def run_job(self, job: Job) -> str:
        """Run one claimed job to its end state; returns the state it ended in (or ``lost``)."""
        reporter = Reporter(self.engine, job.id)
        lease = LeaseKeeper(self.engine, job.id, self.worker_id, self.settings.lease_seconds,
                            self.settings.heartbeat_seconds, reporter)
        ctx = JobContext(self.engine, self.settings, job, self.worker_id, reporter,
                         cancel=lease.cancel, lost=lease.lost, shutdown=self.shutdown)
        self.current = ctx
        workers.touch(self.engine, self.worker_id, job.id)
        log.info("job %s (%s) claimed, attempt %s", job.id, job.kind, job.attempts)
        lease.beat()
        lease.start()
        outcome = "failed"
        try:
            try:
                ctx.check()
                result = handler_for(job.kind)(ctx)
                ctx.check()  # a cancel that arrived as the handler returned still counts
            except JobCancelled:
                reporter.log("cancelled by request")
                reporter.flush()
                outcome = "cancelled" if queue.acknowledge_cancel(
                    self.engine, job.id, self.worker_id) else "lost"
            except LeaseLost:
                outcome = "lost"
            except (WorkerShutdown, KeyboardInterrupt):
                reporter.log("worker shutting down; job returned to the queue", "warning")
                reporter.flush()
                outcome = "queued" if queue.release(
                    self.engine, job.id, self.worker_id, "worker shut down") else "lost"
            except Exception as exc:  # noqa: BLE001 - every failure ends the job, not the worker
                msg = one_line(exc)
                reporter.log(msg, "error", traceback=traceback.format_exc())
                reporter.flush()
                log.error("job %s failed: %s", job.id, msg)
                outcome = "failed" if queue.fail(self.engine, job.id, self.worker_id, msg) else "lost"
            else:
                reporter.flush()
                outcome = "succeeded" if queue.finish(
                    self.engine, job.id, self.worker_id, result or {}) else "lost"
        finally:
            lease.stop()
            reporter.flush()
            self.current = None
            try:
                workers.touch(self.engine, self.worker_id, None)
            except Exception:  # noqa: BLE001
                pass
        log.info("job %s ended: %s", job.id, outcome)
        return outcome
