"""The lease keeper: a thread that renews a job's lease and watches its cancel flag.

Every ``settings.heartbeat_seconds`` it calls :func:`app.store.queue.heartbeat`. When the
database says cancel was requested it sets ``cancel``; when the heartbeat matches no row (the
lease expired and was reaped, or another worker owns the job) it sets ``lost`` and disables the
job's event reporter. It also flushes the reporter and refreshes the worker row.
"""
from __future__ import annotations

import logging
import threading

from sqlalchemy.engine import Engine

from app.store import queue, workers

log = logging.getLogger("worker.lease")


class LeaseKeeper(threading.Thread):
    """Background heartbeat for one claimed job."""

    def __init__(self, engine: Engine, job_id: int, worker_id: str, lease_seconds: float,
                 interval: float, reporter=None):
        super().__init__(name=f"lease-{job_id}", daemon=True)
        self.engine = engine
        self.job_id = job_id
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.interval = interval
        self.reporter = reporter
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self._halt = threading.Event()

    def beat(self) -> None:
        """One heartbeat (also called once before the thread starts looping)."""
        try:
            hb = queue.heartbeat(self.engine, self.job_id, self.worker_id, self.lease_seconds)
        except Exception:  # noqa: BLE001 - a busy DB: try again next beat, the lease has slack
            log.exception("heartbeat of job %s failed", self.job_id)
            return
        if not hb.alive:
            if not self.lost.is_set():
                log.warning("lease of job %s lost; stopping it", self.job_id)
            self.lost.set()
            if self.reporter is not None:
                self.reporter.disable()
            return
        if hb.cancel_requested:
            self.cancel.set()
        if self.reporter is not None:
            self.reporter.flush()
        try:
            workers.touch(self.engine, self.worker_id, self.job_id)
        except Exception:  # noqa: BLE001
            log.exception("could not refresh worker row")

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.beat()
            if self.lost.is_set():
                return

    def stop(self) -> None:
        """Stop the thread and wait for it."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=self.interval + 35)
