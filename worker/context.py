"""What a job handler gets: the job, the store, a reporter and the stop flags.

Handlers call :meth:`JobContext.check` at safe points (every training step); it raises
:class:`JobCancelled`, :class:`LeaseLost` or :class:`WorkerShutdown`, which the loop turns into
``cancelled``, "stop writing" and ``queue.release`` respectively.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Engine

from app.settings import Settings
from app.store.schema import Job
from worker.progress import Reporter


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
        if self.cancel.is_set():
            return "cancelled"
        return None

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
