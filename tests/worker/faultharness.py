"""Harness of the fault tests: a temp studio (data dir + SQLite file) and real worker
processes (fault_worker.py) started, stopped and killed by the tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.store import queue
from app.store.db import make_engine
from app.store.migrate import upgrade
from app.store.schema import JobState

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class Studio:
    """A data dir and database (``db_dir``, default beside it) and the workers started on it."""

    def __init__(self, root: Path, data_dir: Path | None = None, **settings: float):
        self.root = root
        self.data_dir = data_dir or root / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.url = f"sqlite:///{root / 'whetstone.db'}"
        upgrade(self.url)
        self.engine = make_engine(self.url)
        self.env = {**os.environ, "WHETSTONE_DATA_DIR": str(self.data_dir),
                    "WHETSTONE_DATABASE_URL": self.url, "WHETSTONE_SEED_DIR": str(root / "noseed"),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        self.env.pop("TRITON_CACHE_DIR", None)  # the supervisor's default (under data_dir) applies
        defaults = {"lease_seconds": 3, "heartbeat_seconds": 0.3}
        for k, v in {**defaults, **settings}.items():
            self.env[f"WHETSTONE_{k.upper()}"] = str(v)
        self.procs: list[subprocess.Popen] = []

    def worker(self, worker_id: str, *args: str) -> subprocess.Popen:
        """Start a real worker process with the fault-test job kinds."""
        log = open(self.root / f"{worker_id}.log", "ab")
        p = subprocess.Popen([sys.executable, str(HERE / "fault_worker.py"), "--worker-id",
                              worker_id, "--poll-interval", "0.1", *args], cwd=REPO,
                             env=self.env, stdout=log, stderr=log)
        self.procs.append(p)
        return p

    def close(self) -> None:
        """Kill what is left (SIGCONT first, for stopped ones)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(10)
        self.engine.dispose()

    def stop_between_writes(self, proc: subprocess.Popen, tries: int = 50) -> None:
        """SIGSTOP ``proc`` at a moment it holds no SQLite write lock.

        A stop that lands inside the worker's heartbeat commit would leave the database locked
        for every other process until SIGCONT; that is a stall of a different kind than the
        lease tests mean to simulate. So stop, probe with ``BEGIN IMMEDIATE`` (0.2 s budget),
        and on a lock let it run 50 ms and try again.

        Raises AssertionError when no lock-free moment is found in ``tries`` attempts.
        """
        import sqlite3

        path = self.url.removeprefix("sqlite:///")
        for _ in range(tries):
            proc.send_signal(signal.SIGSTOP)
            con = sqlite3.connect(path, timeout=0.2, isolation_level=None)
            try:
                con.execute("BEGIN IMMEDIATE")
                con.execute("ROLLBACK")
                return
            except sqlite3.OperationalError:
                proc.send_signal(signal.SIGCONT)
                time.sleep(0.05)
            finally:
                con.close()
        raise AssertionError(f"worker {proc.pid} held the write lock at every stop")

    def log_of(self, worker_id: str) -> str:
        return (self.root / f"{worker_id}.log").read_text(errors="replace")


def wait_for(pred, timeout: float, what: str, step: float = 0.05):
    """Poll ``pred`` until truthy (returns its value); AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(step)


def state_is(engine, job_id: int, *states: str):
    """The job when it is in one of ``states``, else None."""
    job = queue.get_job(engine, job_id)
    return job if job.state in states else None


def ended(engine, job_id: int):
    """The job once it reached a final state, else None."""
    return state_is(engine, job_id, *JobState.FINAL)
