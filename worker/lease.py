"""The lease keeper: a thread that renews a job's lease and watches its cancel flag.

Every ``settings.heartbeat_seconds`` it calls :func:`app.store.queue.heartbeat`. When the
database says cancel was requested it sets ``cancel``; when the heartbeat matches no row (the
lease expired and was reaped, or another worker owns the job) it sets ``lost`` and disables the
job's event reporter and calls ``on_lost`` (the loop interrupts the handler at once). It also
flushes the reporter, refreshes the worker row and records the process's memory (a ``resource``
event, so that the reaper can say how much it used when it is killed, likely out of memory).
A failed heartbeat (a locked database) is retried after ``RETRY_SECONDS``, not a full interval.

:class:`Reaper` reaps expired leases on its own schedule, busy or idle.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store import queue, workers
from app.store.db import session_scope
from app.store.schema import Worker

log = logging.getLogger("worker.lease")

RETRY_SECONDS = 0.25
#: A new ``resource`` event is written when memory moved by this fraction, or after this long.
MEMORY_CHANGE, MEMORY_EVERY_SECONDS = 0.1, 60.0


class LeaseKeeper(threading.Thread):
    """Background heartbeat for one claimed job."""

    def __init__(self, engine: Engine, job_id: int, worker_id: str, lease_seconds: float,
                 interval: float, reporter=None, on_lost: Callable[[], None] | None = None):
        super().__init__(name=f"lease-{job_id}", daemon=True)
        self.engine = engine
        self.job_id = job_id
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.interval = interval
        self.reporter = reporter
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self.on_lost = on_lost
        self._halt = threading.Event()
        self._memory: tuple[float, float] | None = None  # (rss GiB, monotonic time) last written

    def beat(self) -> bool:
        """One heartbeat (also called once before the thread starts looping); False when the
        database could not be reached (locked, disk full): the caller retries soon."""
        try:
            hb = queue.heartbeat(self.engine, self.job_id, self.worker_id, self.lease_seconds)
        except Exception as exc:  # noqa: BLE001 - a busy DB: retry soon, the lease has slack
            log.warning("heartbeat of job %s failed: %s", self.job_id, str(exc).splitlines()[0])
            return False
        if not hb.alive:
            if not self.lost.is_set():
                log.warning("lease of job %s lost; stopping it", self.job_id)
                self.lost.set()
                if self.reporter is not None:
                    self.reporter.disable()
                if self.on_lost is not None:
                    self.on_lost()
            return True
        if hb.cancel_requested:
            self.cancel.set()
        if self.reporter is not None:
            self.reporter.flush()
        try:
            workers.touch(self.engine, self.worker_id, self.job_id)
        except Exception:  # noqa: BLE001
            log.exception("could not refresh worker row")
        self.record_memory()
        return True

    def record_memory(self) -> None:
        """Write a ``resource`` event when memory moved by :data:`MEMORY_CHANGE` or
        :data:`MEMORY_EVERY_SECONDS` passed since the last one (never raises)."""
        try:
            from worker import gpu

            rss = gpu.rss_gib()
            last = self._memory
            if last and abs(rss - last[0]) <= MEMORY_CHANGE * max(last[0], 1e-3) \
                    and time.monotonic() - last[1] < MEMORY_EVERY_SECONDS:
                return
            gpu_gib = gpu.memory()[0] if gpu.cuda_available() else None
            queue.record_memory(self.engine, self.job_id, rss, gpu_gib)
            self._memory = (rss, time.monotonic())
        except Exception:  # noqa: BLE001 - a measurement must never stop the heartbeat
            log.exception("could not record memory of job %s", self.job_id)

    def run(self) -> None:
        wait = self.interval
        while not self._halt.wait(wait):
            wait = self.interval if self.beat() else min(RETRY_SECONDS, self.interval)
            if self.lost.is_set():
                return

    def stop(self) -> None:
        """Stop the thread and wait for it."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=self.interval + 35)


def gone_workers(engine: Engine, host: str | None = None) -> set[str]:
    """Ids of worker rows on this host (``host``, default this machine's name) whose process
    no longer exists: a worker killed (out of memory, SIGKILL) leaves its row behind."""
    host = host or socket.gethostname()
    with session_scope(engine) as s:
        rows = s.exec(select(Worker).where(Worker.host == host)).all()
    out = set()
    for w in rows:
        try:
            os.kill(w.pid, 0)
        except ProcessLookupError:
            out.add(w.id)
        except OSError:  # alive under another user
            pass
    return out


class Reaper(threading.Thread):
    """Reaps expired leases every ``interval`` seconds for the worker's whole life, whether
    it is idle or running a job, so that a dead job is requeued within lease + interval +
    ``grace`` seconds. Errors (a locked database) are logged and retried next round."""

    def __init__(self, engine: Engine, interval: float, grace: float):
        super().__init__(name="reaper", daemon=True)
        self.engine, self.interval, self.grace = engine, interval, grace
        self._halt = threading.Event()

    def reap_once(self, restarted: str | None = None) -> list[tuple[int, str]]:
        """One round (``restarted``: see :func:`app.store.queue.reap`); returns what it reaped."""
        gone = gone_workers(self.engine)
        reaped = queue.reap(self.engine, restarted, gone=gone, grace=self.grace)
        for job_id, state in reaped:
            log.warning("reaped job %s -> %s", job_id, state)
        return reaped

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                self.reap_once()
            except Exception as exc:  # noqa: BLE001 - a locked database: next round
                log.warning("reap failed: %s", str(exc).splitlines()[0])

    def stop(self) -> None:
        """Stop the thread (does not wait for a reap in progress)."""
        self._halt.set()
