"""What a job handler gets: the job, the store, a reporter and the stop flags.

Handlers call :meth:`JobContext.check` at safe points (every training step); it raises
:class:`JobCancelled`, :class:`LeaseLost` or :class:`WorkerShutdown`, which the loop turns into
``cancelled``, "stop writing" and ``queue.release`` respectively.

The lease thread sees a cancel at its heartbeat (every ``heartbeat_seconds``, 2 s); a trainer
reads the flag itself at every step's end (:meth:`JobContext.step_stop_reason`, at most every
:data:`CANCEL_POLL_SECONDS`), so a cancel stops training within a step or two.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Engine

from app.settings import Settings
from app.store import queue
from app.store.schema import Job
from worker.progress import Reporter


#: A step's end reads the job's cancel flag at most this often (seconds): a fast run (many
#: steps a second) reads the database a few times a second, not once a step.
CANCEL_POLL_SECONDS = 0.2


class JobInterrupted(BaseException):
    """Base of the ways a job is stopped from outside (not failures)."""


class JobCancelled(JobInterrupted):
    """The user cancelled the job."""


class LeaseLost(JobInterrupted):
    """Our lease expired or another worker took the job: stop writing for it."""


class WorkerShutdown(JobInterrupted):
    """SIGTERM/SIGINT: stop now, the job goes back to the queue."""


class JobError(Exception):
    """A failure whose message is already clear for the user (no exception type shown)."""


@dataclass
class JobContext:
    """Everything a job handler needs."""

    engine: Engine
    settings: Settings
    job: Job
    worker_id: str
    reporter: Reporter
    cancel: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)
    shutdown: threading.Event = field(default_factory=threading.Event)
    #: What a cancel must undo (see :meth:`on_cancel`), run newest first.
    undo: list[Callable[[], None]] = field(default_factory=list)
    #: Training ended on its own before a cancel took effect (:meth:`cancel_came_too_late`):
    #: from then on a cancel no longer stops the job.
    cancel_moot: bool = False
    _cancel_read_at: float = field(default=float("-inf"), repr=False)
    _late_cancel_told: bool = field(default=False, repr=False)

    def on_cancel(self, fn: Callable[[], None]) -> None:
        """Have ``fn()`` run when the job ends cancelled (the loop calls :meth:`undo_written`
        before it records the cancel): a job that writes files or artifacts registers how to
        remove them, so a cancelled job leaves nothing half-written behind. ``fn`` runs even
        when the cancel arrives after the handler returned (its files and artifact rows already
        written); it must not raise for something that was never written."""
        self.undo.append(fn)

    def undo_written(self) -> None:
        """Run the :meth:`on_cancel` callbacks, newest first; a failing one is logged and the
        others still run."""
        while self.undo:
            fn = self.undo.pop()
            try:
                fn()
            except Exception:  # noqa: BLE001 - the cancel must still be recorded
                logging.getLogger("worker").exception("job %s: cleanup after cancel failed",
                                                      self.job.id)

    @property
    def payload(self) -> dict[str, Any]:
        return self.job.payload

    def stop_reason(self) -> str | None:
        """``lost`` | ``shutdown`` | ``cancelled`` when the job must stop, else None."""
        if self.lost.is_set():
            return "lost"
        if self.shutdown.is_set():
            return "shutdown"
        if self.cancel.is_set() and not self.cancel_moot:
            return "cancelled"
        return None

    def poll_cancel(self, force: bool = False) -> bool:
        """Read the job's cancel flag from the database now, unless it was read less than
        :data:`CANCEL_POLL_SECONDS` ago (``force``: read anyway); sets :attr:`cancel` when a
        cancel was requested. Returns whether the cancel is set. A failed read (a locked
        database) is skipped: the heartbeat still sees the cancel."""
        now = time.monotonic()
        if not self.cancel.is_set() and (force or
                                         now - self._cancel_read_at >= CANCEL_POLL_SECONDS):
            self._cancel_read_at = now
            try:
                if queue.cancel_requested(self.engine, self.job.id):
                    self.cancel.set()
            except Exception as exc:  # noqa: BLE001 - the next step or heartbeat reads it
                logging.getLogger("worker").warning("job %s: could not read its cancel flag: %s",
                                                    self.job.id, str(exc).splitlines()[0])
        return self.cancel.is_set()

    def step_stop_reason(self) -> str | None:
        """:meth:`stop_reason` at a training step's end, after :meth:`poll_cancel`: what the
        trainer callback asks after every step."""
        self.poll_cancel()
        return self.stop_reason()

    def cancel_came_too_late(self, step: int, max_steps: int) -> bool:
        """Call when training ended on its own (not stopped by a cancel), and again as the
        handler returns: a cancel requested by now (read again from the database) arrived
        after the last step, so the job finishes anyway (its adapter is trained) and its log
        says so, once. From then on a cancel no longer stops the job. Returns whether a cancel
        was requested."""
        self.cancel_moot = True
        if not self.poll_cancel(force=True):
            return False
        if not self._late_cancel_told:
            self._late_cancel_told = True
            self.log(f"cancel arrived after the last step ({step} of {max_steps}); the run "
                     "finished", "warning")
        return True

    def check(self) -> None:
        """Raise the matching :class:`JobInterrupted` when the job must stop."""
        reason = self.stop_reason()
        if reason == "lost":
            raise LeaseLost()
        if reason == "shutdown":
            raise WorkerShutdown()
        if reason == "cancelled":
            raise JobCancelled()

    def log(self, message: str, level: str = "info", **extra: Any) -> None:
        self.reporter.log(message, level, **extra)

    def metric(self, **data: Any) -> None:
        self.reporter.metric(**data)

    def progress(self, stage: str, done: float, total: float, message: str | None = None) -> None:
        self.reporter.progress(stage, done, total, message)
