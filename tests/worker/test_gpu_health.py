"""A real supervisor on a box without a GPU samples its CPU slot (host utilisation and RAM) for
the dashboard, and ``python -m worker --health`` (the worker image's HEALTHCHECK) follows its
heartbeat: healthy while it runs, unhealthy when it hangs (stopped) and once it has exited."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from app.store import gpu_samples
from faultharness import REPO, Studio, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="processes and signals: Linux")


def health(studio: Studio, worker_id: str = "sup") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", "--health", "--worker-id", worker_id],
                          cwd=REPO, env={**studio.env, "WHETSTONE_WORKER_STALE_SECONDS": "3"},
                          capture_output=True, text=True, timeout=60)


def test_cpu_slot_samples_and_the_health_command_follows_the_heartbeat(tmp_path) -> None:
    studio = Studio(tmp_path, gpu_sample_seconds=0.2)
    try:
        before = health(studio)
        assert before.returncode == 1
        assert "worker sup: no heartbeat row (not started, or stopped)" in before.stderr
        sup = studio.worker("sup", "--supervise")
        rows = wait_for(lambda: [s for s in gpu_samples.since(studio.engine, 0)
                                 if s.slot == "sup-main"][2:], 60, "three CPU-slot samples")
        s = rows[-1]
        assert (s.source, s.gpu_index, s.jobs, s.temp_c, s.power_w) == ("cpu", None, [], None, None)
        total = psutil.virtual_memory().total / 2**30
        assert abs(s.mem_total_gib - total) < 0.01 and 0 < s.mem_used_gib < s.mem_total_gib
        assert 0.0 <= s.util_pct <= 100.0 and s.name.startswith("cpu slot (")
        gaps = [b.ts - a.ts for a, b in zip(rows, rows[1:])]
        assert all(0.15 < g < 3.0 for g in gaps), gaps  # every gpu_sample_seconds, not every poll
        ok = health(studio)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.startswith("worker sup: heartbeat ") and ok.stdout.rstrip().endswith(" s ago")
        sup.send_signal(signal.SIGSTOP)  # hung: the heartbeat row goes stale
        try:
            time.sleep(4.0)
            hung = health(studio)
        finally:
            sup.send_signal(signal.SIGCONT)
        assert hung.returncode == 1 and "worker sup: last heartbeat " in hung.stderr
        assert "(stale after 3 s)" in hung.stderr
        assert health(studio, "other").returncode == 1
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0
        gone = health(studio)
        assert gone.returncode == 1 and "no heartbeat row" in gone.stderr
    finally:
        studio.close()
