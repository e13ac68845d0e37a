"""The worker loop: claim a job, dispatch on ``job.kind``, end it fenced; repeat.

* At start: migrate the database, register the worker, reap expired leases and the jobs a
  previous process with this worker id died holding, seed the demo model; each step is retried
  while the database is locked or the disk full (the start waits, the process never ends).
* A :class:`worker.lease.Reaper` thread reaps expired leases every few seconds, idle or busy
  (another worker may have died); a job whose worker process died says so, with its memory.
* A locked database or a full disk never ends the process: the job fails with the cause
  ("disk full: 0 bytes free in the data dir ...") or its end is retried; the loop backs off.
* A lost lease interrupts the handler at once (:func:`worker.faults.interrupt`).
* A handler that raises fails its job with a one-line message (the traceback goes into a
  ``log`` event) and the worker keeps serving.
* Cancel (seen by the lease thread, or read by a trainer at a step's end) -> the handler stops
  at its next check -> ``cancelled``; one that arrives after training's last step does not
  (the job succeeds and its log says the cancel came too late).
* SIGTERM/SIGINT -> the handler stops at its next check (training saves a checkpoint) -> the
  job is released back to ``queued`` -> the worker unregisters and exits 0.
"""
from __future__ import annotations

import errno
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
from worker import faults, gpu
from worker.context import (JobCancelled, JobContext, JobError, LeaseLost, WorkerShutdown)
from worker.lease import LeaseKeeper, Reaper
from worker.progress import Reporter

log = logging.getLogger("worker")

#: The reaper runs at least this often (seconds), so a dead job waits at most about
#: lease + this + the grace below before it is requeued, busy workers or not.
REAP_MAX_PERIOD_SECONDS = 1.5
#: Seconds past its expiry before a lease is reaped (a blocked heartbeat's chance to land).
REAP_GRACE_SECONDS = 2.0

#: job kind -> "module:function" taking a JobContext and returning the result dict.
HANDLERS: dict[str, str] = {
    "import_model": "worker.jobs.import_model:run",
    "train": "worker.jobs.train:run",
    "grpo": "worker.jobs.grpo:run",
    "evaluate": "worker.jobs.checkpoint_eval:run",
    "export": "worker.jobs.export:run",
    "validate_dataset": "worker.jobs.validate_dataset:run",
    "playground": "worker.jobs.playground:run",
}
#: Kinds that need no GPU: with a CPU lane (the default) they are claimed by a second loop of
#: the worker process and never wait behind a training job; train and grpo stay on the main lane.
CPU_KINDS = queue.CPU_KINDS


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
        self.reaper: Reaper | None = None
        self._handler_lock = threading.Lock()
        self._handler_thread: int | None = None  # thread id while a handler runs
        self.lane: Worker | None = None  # the CPU lane this worker started, if any
        self._lane_thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Migrate, register, reap (also the jobs this worker id's previous process died
        holding), start the reaper thread, seed the demo model."""
        from app.store import migrate

        self.settings.ensure_dirs()
        url = self.settings.resolved_database_url
        self.retry_start("migrate the database", lambda: migrate.upgrade(url))
        self.engine = get_engine(url)
        total = gpu.total_gib() if {"train", "grpo"} & set(self.kinds) else None
        self.retry_start(f"register worker {self.worker_id}", lambda: workers.register(
            self.engine, self.worker_id, socket.gethostname(), os.getpid(), gpu.device_name(),
            total))
        self.reaper = Reaper(self.engine, min(self.settings.reap_interval_seconds,
                                              REAP_MAX_PERIOD_SECONDS), REAP_GRACE_SECONDS)
        self.retry_start("reap expired leases",
                         lambda: self.reaper.reap_once(restarted=self.worker_id))
        self.reaper.start()
        try:
            from app.store.seed import ensure_demo_model

            self.retry_start("register the demo model",
                             lambda: ensure_demo_model(self.engine, self.settings))
        except faults.StartStopped:
            raise
        except Exception:  # noqa: BLE001 - the demo model is a convenience, never fatal
            log.exception("could not register the demo model")
        log.info("worker %s ready on %s (kinds: %s)", self.worker_id, gpu.device_name(),
                 ", ".join(self.kinds))

    def retry_start(self, what: str, step: Callable[[], Any]) -> Any:
        """Run one step of the start again while the database is locked or the disk full
        (:func:`worker.faults.retry_start`); raises ``faults.StartStopped`` on shutdown."""
        return faults.retry_start(what, step, self.settings.data_dir, self.shutdown,
                                  self.settings.sqlite_busy_timeout_seconds)

    def start_cpu_lane(self, kinds: tuple[str, ...] = CPU_KINDS) -> Worker:
        """Start a second claim loop in this process (its own thread, worker id
        ``<id>-cpu``, lease and heartbeat) that claims only ``kinds``, so that CPU work (exports,
        imports, dataset validation) runs beside a training job instead of behind it. It shares
        this worker's shutdown flag; :meth:`stop` waits for it. Call after :meth:`start`."""
        lane = Worker(self.settings, f"{self.worker_id}-cpu", list(kinds), self.poll_interval)
        lane.engine, lane.shutdown = self.engine, self.shutdown
        self.retry_start(f"register worker {lane.worker_id}", lambda: workers.register(
            self.engine, lane.worker_id, socket.gethostname(), os.getpid(),
            f"{gpu.device_name()} (cpu lane)"))
        if self.reaper is not None:
            self.retry_start("reap expired leases",
                             lambda: self.reaper.reap_once(restarted=lane.worker_id))
        self.lane = lane
        self._lane_thread = threading.Thread(target=lane.serve, name="cpu-lane", daemon=True)
        self._lane_thread.start()
        log.info("cpu lane %s ready (kinds: %s)", lane.worker_id, ", ".join(lane.kinds))
        return lane

    def stop(self) -> None:
        """Stop the CPU lane (its job goes back to the queue) and the reaper, unregister
        (called on exit)."""
        if self._lane_thread is not None:
            self.shutdown.set()
            self._lane_thread.join(timeout=self.settings.lease_seconds)
            try:
                workers.unregister(self.engine, self.lane.worker_id)
            except Exception:  # noqa: BLE001
                log.exception("could not unregister worker %s", self.lane.worker_id)
        if self.reaper is not None:
            self.reaper.stop()
        if self.engine is not None:
            try:
                workers.unregister(self.engine, self.worker_id)
            except Exception:  # noqa: BLE001
                log.exception("could not unregister worker %s", self.worker_id)

    def request_shutdown(self) -> None:
        """Signal handler body: stop the current job at its next check and leave the loop."""
        self.shutdown.set()

    # ---- the loop ------------------------------------------------------------------------
    def serve(self, once: bool = False) -> int:
        """Claim and run jobs until shutdown (or after one job with ``once``). Returns 0.

        A database or disk fault (locked past the busy timeout, disk full) never ends the loop:
        it is logged and the loop backs off (1 s doubling to 30 s); with less than
        :data:`worker.faults.MIN_FREE_BYTES` free in the data dir no job is claimed."""
        backoff = faults.Backoff()
        while not self.shutdown.is_set():
            try:
                free = faults.free_bytes(self.settings.data_dir)
                if 0 <= free < faults.MIN_FREE_BYTES:
                    raise OSError(errno.ENOSPC, "no space left in the data dir")
                job = queue.claim(self.engine, self.worker_id, self.settings.lease_seconds,
                                  self.kinds)
                if job is None:
                    workers.touch(self.engine, self.worker_id, None)
                    backoff.reset()
                    self.shutdown.wait(self.poll_interval)
                    continue
            except Exception as exc:  # noqa: BLE001 - back off, keep serving
                delay = backoff.delay()
                log.error("cannot claim a job (%s); retrying in %.0f s",
                          faults.describe(exc, self.settings.data_dir) or one_line(exc), delay)
                self.shutdown.wait(delay)
                continue
            backoff.reset()
            self.run_job(job)
            if once:
                break
        return 0

    def _on_lost(self) -> None:
        """The lease thread saw the lease lost: stop the handler now, mid-step if need be."""
        with self._handler_lock:
            if self._handler_thread is not None:
                faults.interrupt(self._handler_thread, LeaseLost)

    def _call_handler(self, ctx: JobContext) -> dict[str, Any] | None:
        """Run the job's handler; a lost lease interrupts it wherever it is (see _on_lost)."""
        with self._handler_lock:
            self._handler_thread = threading.get_ident()
        try:
            ctx.check()
            result = handler_for(ctx.job.kind)(ctx)
            ctx.check()  # a cancel that arrived as the handler returned still counts
            return result
        finally:
            with self._handler_lock:
                self._handler_thread = None
                faults.clear_interrupt(threading.get_ident())

    def _end(self, ctx: JobContext, end: Callable[..., bool], *args: Any) -> bool:
        """A fenced end (finish/fail/...) retried with backoff while the database is locked or
        the disk full, until it lands, the lease is lost or a lease's time has passed."""
        backoff, deadline = faults.Backoff(0.5, 5.0), time.monotonic() + self.settings.lease_seconds
        while True:
            try:
                return end(self.engine, ctx.job.id, self.worker_id, *args)
            except Exception as exc:  # noqa: BLE001
                cause = faults.describe(exc, self.settings.data_dir) or one_line(exc)
                if ctx.lost.is_set() or time.monotonic() > deadline:
                    log.error("job %s: could not record its end (%s); the reaper will", ctx.job.id,
                              cause)
                    return False
                log.warning("job %s: could not record its end (%s); retrying", ctx.job.id, cause)
                time.sleep(backoff.delay())

    def _end_cancelled(self, ctx: JobContext, reporter: Reporter) -> str:
        """Record a cancelled job's end after undoing what it wrote (no half-written file or
        artifact of it stays); ``cancelled``, or ``lost`` when the lease went first."""
        ctx.undo_written()
        reporter.log("cancelled by request")
        reporter.flush()
        return "cancelled" if self._end(ctx, queue.acknowledge_cancel) else "lost"

    def run_job(self, job: Job) -> str:
        """Run one claimed job to its end state; returns the state it ended in (or ``lost``)."""
        reporter = Reporter(self.engine, job.id)
        lease = LeaseKeeper(self.engine, job.id, self.worker_id, self.settings.lease_seconds,
                            self.settings.heartbeat_seconds, reporter, on_lost=self._on_lost)
        ctx = JobContext(self.engine, self.settings, job, self.worker_id, reporter,
                         cancel=lease.cancel, lost=lease.lost, shutdown=self.shutdown)
        self.current = ctx
        log.info("job %s (%s) claimed, attempt %s", job.id, job.kind, job.attempts)
        lease.beat()
        lease.start()
        outcome = "failed"
        try:
            try:
                result = self._call_handler(ctx)
            except JobCancelled:
                outcome = self._end_cancelled(ctx, reporter)
            except LeaseLost:
                outcome = "lost"
            except (WorkerShutdown, KeyboardInterrupt):
                # info, not warning: the job resumes from its checkpoint; a warning would stay in
                # the run page's Warnings box after it resumed
                reporter.log("worker shutting down; job returned to the queue", "info")
                reporter.flush()
                outcome = "queued" if self._end(ctx, queue.release, "worker shut down") else "lost"
            except Exception as exc:  # noqa: BLE001 - every failure ends the job, not the worker
                msg = faults.describe(exc, self.settings.data_dir) or one_line(exc)
                reporter.log(msg, "error", traceback=traceback.format_exc())
                reporter.flush()
                log.error("job %s failed: %s", job.id, msg)
                outcome = "failed" if self._end(ctx, queue.fail, msg) else "lost"
            else:
                reporter.flush()
                if not ctx.undo or ctx.cancel_moot:  # moot: training ended before the cancel
                    outcome = "succeeded" if self._end(ctx, queue.finish, result or {}) \
                        else "lost"
                else:  # a job that can undo what it wrote honours a cancel until its very end
                    done = self._end(ctx, queue.finish_unless_cancelled, result or {})
                    outcome = self._end_cancelled(ctx, reporter) if done is None \
                        else "succeeded" if done else "lost"
        except LeaseLost:  # the interrupt landed just after the handler returned
            outcome = "lost"
        finally:
            lease.stop()
            reporter.flush()
            self.current = None
            try:
                workers.touch(self.engine, self.worker_id, None)
            except Exception:  # noqa: BLE001
                pass
        log.info("job %s ended: %s", job.id, outcome)
        if outcome in ("succeeded", "failed", "cancelled"):
            from worker import notify

            notify.run_ended(self.engine, job.id, self.settings)  # a run's webhook, own thread
        return outcome
