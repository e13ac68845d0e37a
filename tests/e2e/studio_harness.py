"""Helpers for end-to-end tests: the web process and one CPU worker as subprocesses.

Both run from this checkout against a temporary data dir and SQLite file, exactly as
``make run`` starts them (settings through ``WHETSTONE_*`` variables), with the demo model
seeded from ../shared/data. The fixture waits until ``/healthz`` lists the worker and the
demo model is ready, and on teardown sends SIGTERM and checks both exit.
"""
from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SHARED = (ROOT / ".." / "shared" / "data").resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Studio:
    url: str
    data_dir: Path
    web: subprocess.Popen
    worker: subprocess.Popen
    logs: Path

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def tail_logs(self) -> str:
        out = []
        for name in ("web.log", "worker.log"):
            p = self.logs / name
            if p.exists():
                out.append(f"--- {name}\n" + p.read_text(errors="replace")[-4000:])
        return "\n".join(out)


def wait_for(predicate, timeout: float, what: str, studio: Studio | None = None, every: float = 0.3):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = predicate()
            if last:
                return last
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(every)
    logs = studio.tail_logs() if studio else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})\n{logs}")


