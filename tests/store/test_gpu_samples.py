"""gpu_samples: writing prunes every sample older than the window; the dashboard thins an hour
of samples to its most points, newest kept, and leaves out a GPU whose samples aged out."""
from __future__ import annotations

from app.settings import Settings
from app.store import gpu_samples, workers
from app.store.db import make_engine
from app.store.migrate import upgrade
from app.store.schema import GpuSample, User, now
from app.studio import gpu_view


def _engine(tmp_path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    return url, make_engine(url)


def _sample(ts: float, slot: str = "box-gpu0", used: float = 1.0) -> GpuSample:
    return GpuSample(ts=ts, slot=slot, host="box", gpu_index=0, name="cuda:0 NVIDIA H200",
                     source="nvml", util_pct=50.0, mem_used_gib=used, mem_total_gib=139.8,
                     temp_c=40.0, power_w=300.0, jobs=[7])


def test_record_prunes_samples_older_than_two_hours(tmp_path) -> None:
    _, eng = _engine(tmp_path)
    t = now()
    assert gpu_samples.record(eng, [_sample(t - 7300), _sample(t - 7100)]) == 1  # its own old one
    assert gpu_samples.record(eng, [_sample(t)]) == 0
    assert [round(t - s.ts) for s in gpu_samples.since(eng, 0)] == [7100, 0]
    assert gpu_samples.record(eng, [_sample(t)], keep_seconds=60) == 1
    left = gpu_samples.since(eng, 0)
    assert len(left) == 2 and all(s.jobs == [7] and s.power_w == 300.0 for s in left)
    assert gpu_samples.latest(eng, "box-gpu0").ts == t and gpu_samples.latest(eng, "x") is None


def test_dashboard_thins_the_hour_and_drops_stale_gpus(tmp_path) -> None:
    url, eng = _engine(tmp_path)
    t = now()
    # 1000 samples over the last hour of a GPU whose supervisor stopped 10 s ago (no worker
    # row), and one sample 70 minutes old of another GPU: outside the hour, so not shown
    gpu_samples.record(eng, [_sample(t - 3599 + 3.6 * i, used=float(i)) for i in range(1000)]
                       + [_sample(t - 4200, slot="old-gpu0")])
    admin = User(id="user-a", name="root", password_hash="x", role="admin")
    data = gpu_view.dashboard(eng, Settings(database_url=url), admin, max_points=100)
    assert [(g["id"], g["live"]) for g in data["gpus"]] == [("box-gpu0", False)]
    h = data["gpus"][0]["history"]
    assert len(h["ts"]) == 100 and h["mem_used_gib"][-1] == 999.0  # newest kept
    assert h["mem_used_gib"][:3] == [9.0, 19.0, 29.0]  # every 10th
    assert data["gpus"][0]["current"]["mem_used_gib"] == 999.0
    # a live slot without samples yet is listed with no figures
    workers.register(eng, "new-gpu0", "new", 1, "cuda:0 NVIDIA H200", 139.8, 0, 137.8)
    data = gpu_view.dashboard(eng, Settings(database_url=url), admin)
    assert [(g["id"], g["live"], g["current"]) for g in data["gpus"]] == [
        ("box-gpu0", False, data["gpus"][0]["current"]), ("new-gpu0", True, None)]
    series = gpu_view.chart_series(data)
    assert series["window_minutes"] == 60.0
    pts = series["gpus"][0]["util_pct"]
    assert pts[-1]["y"] == 50.0 and -0.1 < pts[-1]["x"] <= 0 and -60.0 <= pts[0]["x"] < -59.0
