"""The ``studio`` fixture: a real web process and CPU worker (see studio_harness.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from studio_harness import ROOT, SHARED, Studio, free_port, wait_for


@pytest.fixture(scope="session")
def studio(tmp_path_factory) -> Studio:
    if not (SHARED / "models" / "stories260K" / "stories260K.bin").exists():
        pytest.fail(f"shared data not found at {SHARED}")
    data_dir = tmp_path_factory.mktemp("studio-data")
    logs = tmp_path_factory.mktemp("studio-logs")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHETSTONE_")}
    env.update({
        "WHETSTONE_DATA_DIR": str(data_dir), "WHETSTONE_HOST": "127.0.0.1",
        "WHETSTONE_PORT": str(port), "WHETSTONE_SEED_DIR": str(SHARED),
        "WHETSTONE_HEARTBEAT_SECONDS": "0.5", "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "WHETSTONE_ADMIN_PASSWORD": Studio.admin_password,
        # the journey's playground session must not hold the one CPU slot for the default 5
        # minutes while the next test's run waits behind it
        "WHETSTONE_PLAYGROUND_IDLE_SECONDS": "5",
    })
    web = subprocess.Popen([sys.executable, "-m", "app.web.main"], cwd=ROOT, env=env,
                           stdout=open(logs / "web.log", "w"), stderr=subprocess.STDOUT)
    worker = subprocess.Popen([sys.executable, "-m", "worker", "--poll-interval", "0.3"],
                              cwd=ROOT, env=env, stdout=open(logs / "worker.log", "w"),
                              stderr=subprocess.STDOUT)
    s = Studio(url=f"http://127.0.0.1:{port}", data_dir=data_dir, web=web, worker=worker, logs=logs)
    try:
        with s.client() as c:
            wait_for(lambda: c.get("/healthz").json()["live_workers"], 120, "a live worker in /healthz",
                     s)
        s.create_api_key()
        with s.client() as c:

            def demo_ready():
                models = c.get("/api/models").json()
                models = models.get("data", models) if isinstance(models, dict) else models
                return [m for m in models if m["name"] == "stories260K" and m["status"] == "ready"]

            wait_for(demo_ready, 180, "stories260K to be imported", s)
        yield s
    finally:
        for p in (worker, web):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (worker, web):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
