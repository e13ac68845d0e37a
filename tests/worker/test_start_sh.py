"""docker/start.sh supervises every process: the web process it started, killed, comes back
(with the workers untouched), and SIGTERM to the script stops everything and exits 0."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from faultharness import REPO, wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="bash and signals: Linux")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _children(pid: int, module: str) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if module in p.cmdline():
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_start_sh_restarts_a_killed_web_process_and_stops_cleanly(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "WHETSTONE_DATA_DIR": str(tmp_path / "data"),
           "WHETSTONE_DATABASE_URL": "", "WHETSTONE_PORT": str(port),
           "WHETSTONE_HOST": "127.0.0.1", "WHETSTONE_PYTHON": sys.executable,
           "WHETSTONE_SEED_DIR": str(tmp_path / "noseed"), "WHETSTONE_WEB_RESTART_SECONDS": "1",
           "WHETSTONE_WORKER_RESTART_SECONDS": "1", "PATH": "/usr/bin:/bin"}
    log = open(tmp_path / "start.log", "wb")
    sh = subprocess.Popen(["bash", str(REPO / "docker" / "start.sh")], cwd=REPO, env=env,
                          stdout=log, stderr=log, start_new_session=True)
    try:
        wait_for(lambda: _healthy(port), 60, "web up", step=0.3)
        web = _children(sh.pid, "app.web.main")
        worker = _children(sh.pid, "worker")
        assert len(web) == 1 and len(worker) == 1
        web[0].kill()
        t0 = time.monotonic()
        wait_for(lambda: not _healthy(port), 10, "web down", step=0.1)
        wait_for(lambda: _healthy(port), 30, "web back", step=0.2)
        print(f"web back {time.monotonic() - t0:.1f} s after SIGKILL")
        again = _children(sh.pid, "app.web.main")
        assert len(again) == 1 and again[0].pid != web[0].pid
        assert worker[0].is_running() and _children(sh.pid, "worker")[0].pid == worker[0].pid
        assert sh.poll() is None
        sh.send_signal(signal.SIGTERM)
        assert sh.wait(40) == 0
        assert not again[0].is_running() and not worker[0].is_running()
    finally:
        if sh.poll() is None:
            os.killpg(sh.pid, signal.SIGKILL)
        log.close()
        print((tmp_path / "start.log").read_text(errors="replace")[-3000:])
