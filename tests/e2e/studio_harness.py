"""Helpers for end-to-end tests: the web process and one CPU worker as subprocesses, with an
admin created through ``WHETSTONE_ADMIN_PASSWORD`` and an API key for the clients.

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
    admin_user: str = "admin"
    admin_password: str = "e2e-admin-password"
    api_key: str | None = None

    def client(self, timeout: float = 30.0) -> httpx.Client:
        """An httpx client that sends the admin's API key (once the fixture created one)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def create_api_key(self) -> str:
        """Sign in as the admin (OAuth2 password flow) and create an API key; remember it."""
        with httpx.Client(base_url=self.url, timeout=30) as c:
            r = c.post("/api/login/access-token",
                       data={"username": self.admin_user, "password": self.admin_password})
            r.raise_for_status()
            r = c.post("/api/keys", json={"name": "e2e"},
                       headers={"Authorization": f"Bearer {r.json()['access_token']}"})
            r.raise_for_status()
            self.api_key = r.json()["key"]
        return self.api_key

    def processed(self, dataset_id: str, timeout: float = 120) -> dict:
        """The dataset once its background validation finished (``processed``); fails on
        ``error`` or after ``timeout`` seconds."""
        with self.client() as c:
            ds = wait_for(lambda: (lambda d: d if d["status"] != "validating" else None)(
                c.get(f"/api/datasets/{dataset_id}").json()), timeout,
                f"dataset {dataset_id} to be validated", self)
        assert ds["status"] == "processed", ds
        return ds

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


