"""The GPU dashboard in a real headless Chromium: Chart.js draws one chart per figure with a line
per GPU from the samples in the database, and the htmx poll brings a new sample into the figures
and the charts without a reload (the same chart objects take the new points)."""
from __future__ import annotations

import pytest

from app.settings import Settings
from app.store import gpu_samples, workers
from app.store.schema import GpuSample, now
from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]


@pytest.fixture
def settings(tmp_path) -> Settings:  # the page polls every second
    return Settings(data_dir=tmp_path / "data", seed_dir=SHARED if SHARED.is_dir() else None,
                    admin_user=ADMIN_USER, admin_password=ADMIN_PASSWORD, gpu_sample_seconds=1)


def _sample(ts: float, index: int, util: float, used: float) -> GpuSample:
    return GpuSample(ts=ts, slot=f"box-gpu{index}", host="box", gpu_index=index,
                     name=f"cuda:{index} NVIDIA H200", source="nvml", util_pct=util,
                     mem_used_gib=used, mem_total_gib=139.8, temp_c=40.0 + index, power_w=300.0,
                     jobs=[])


def _points(page) -> dict:
    return page.evaluate("""() => Object.fromEntries(Object.entries(window.whetstoneGpuCharts)
        .map(([k, c]) => [k, c.data.datasets.map((d) => [d.label, d.data.length,
                                                         d.data.length ? d.data[d.data.length - 1].y : null])]))""")


def test_charts_draw_every_gpu_and_take_new_samples_live(page, app) -> None:
    eng = app.state.engine
    for i in (0, 1):
        workers.register(eng, f"box-gpu{i}", "box", 1, f"cuda:{i} NVIDIA H200", 139.8, i, 137.8)
    t = now()
    gpu_samples.record(eng, [_sample(t - 60 * m, i, 10.0 * m, 1.0 + m)
                             for m in (30, 20, 10) for i in (0, 1)])
    page.goto(f"{page.base}/gpus")
    page.wait_for_function("() => window.whetstoneGpuCharts && "
                           "Object.keys(window.whetstoneGpuCharts).length === 4")
    assert _points(page) == {
        "util_pct": [["box GPU 0", 3, 100.0], ["box GPU 1", 3, 100.0]],
        "mem_used_gib": [["box GPU 0", 3, 11.0], ["box GPU 1", 3, 11.0]],
        "temp_c": [["box GPU 0", 3, 40.0], ["box GPU 1", 3, 41.0]],
        "power_w": [["box GPU 0", 3, 300.0], ["box GPU 1", 3, 300.0]]}
    page.evaluate("() => { window.firstChart = window.whetstoneGpuCharts.util_pct; }")
    assert "100 %" in page.inner_text("section.gpu[data-slot='box-gpu1'] .gpu-util")
    gpu_samples.record(eng, [_sample(now(), 1, 87.0, 64.5)])
    page.wait_for_function("() => window.whetstoneGpuCharts.util_pct.data.datasets[1]"
                           ".data.length === 4", timeout=15_000)
    got = _points(page)
    assert got["util_pct"] == [["box GPU 0", 3, 100.0], ["box GPU 1", 4, 87.0]]
    assert got["mem_used_gib"][1] == ["box GPU 1", 4, 64.5]
    assert page.evaluate("() => window.firstChart === window.whetstoneGpuCharts.util_pct")
    gpu1 = "section.gpu[data-slot='box-gpu1']"
    page.wait_for_function(f"() => document.querySelector(\"{gpu1} .gpu-util\")"
                           ".textContent.includes('87 %')")
    assert "64.5 of 139.8 GiB" in page.inner_text(f"{gpu1} .gpu-mem")
    assert page.url.endswith("/gpus")  # no reload: polled in place
