"""``python -m app.web.health`` (the web image's HEALTHCHECK) against a real uvicorn that serves
only the team's host name: healthy with that name in WHETSTONE_ALLOWED_HOSTS (a plain request
for 127.0.0.1 is refused there), unhealthy when nothing listens on the port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def settings(tmp_path) -> Settings:  # the app of the `server` fixture serves studio.example only
    return Settings(data_dir=tmp_path / "data", allowed_hosts="studio.example")


def health(port: int, allowed: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WHETSTONE_PORT": str(port), "WHETSTONE_ALLOWED_HOSTS": allowed}
    return subprocess.run([sys.executable, "-m", "app.web.health"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_health_command_asks_healthz_with_a_served_host_name(server) -> None:
    port = int(server.rsplit(":", 1)[1])
    assert httpx.get(f"{server}/healthz").status_code == 400  # Host 127.0.0.1 is not served
    ok = health(port, "studio.example, other.example")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("web: degraded (database sqlite, 0 live workers)")
    refused = health(port, "")  # asks as 127.0.0.1, which this app refuses
    assert refused.returncode == 1 and "HTTP Error 400" in refused.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    down = health(free, "studio.example")
    assert down.returncode == 1 and down.stderr.startswith("web: /healthz did not answer: ")
