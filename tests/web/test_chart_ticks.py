"""Chart tick labels (static/ticks.js, used by every chart): an axis's labels share one format
with enough decimals that neighbours differ (losses 22.24..22.31 read 22.24, 22.25, …, not
22.2, 22.2, 22.3), and a step axis has whole steps only (not 1.10). Node checks the labelling;
a headless Chromium checks the compare page's and the run page's real Chart.js axes."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from app.store import events, queue, repo
from tests.web.conftest import upload_sft
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

TICKS = Path(__file__).resolve().parents[2] / "static" / "ticks.js"


def _labels(axes: list[list[float]]) -> list[list[str]]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    js = (f"global.window = {{}}; require({json.dumps(str(TICKS))}); "
          f"const axes = {json.dumps(axes)}; console.log(JSON.stringify(axes.map((vs) => "
          "vs.map((v, i) => window.whetstoneTick(v, i, vs.map((value) => ({ value })))))))")
    out = subprocess.run([node, "-e", js], capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout)


def test_axis_labels_differ_and_show_the_step():
    assert _labels([[22.2, 22.25, 22.3, 22.35, 22.4],
                    [22.24, 22.25, 22.26, 22.27],
                    [0, 0.5, 1, 1.5],
                    [-0.1, -0.05, 0, 0.05],
                    [0, 20, 40, 60, 80, 100],
                    [1e-5, 1.5e-5, 2e-5],
                    [0, 50000, 100000, 150000],
                    [3.1, 3.2, 3.3000000000000003]]) == [
        ["22.20", "22.25", "22.30", "22.35", "22.40"],
        ["22.24", "22.25", "22.26", "22.27"],
        ["0.0", "0.5", "1.0", "1.5"],
        ["-0.10", "-0.05", "0.00", "0.05"],
        ["0", "20", "40", "60", "80", "100"],
        ["1e-5", "1.5e-5", "2e-5"],
        ["0", "5e+4", "1e+5", "1.5e+5"],
        ["3.1", "3.2", "3.3"]]


def _run_with_losses(client, engine, losses: list[float], name: str) -> str:
    ds = upload_sft(client)
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "name": name,
                                       "max_steps": len(losses)})
    assert r.status_code == 201, r.text
    run = repo.get_run(engine, r.json()["id"])
    assert queue.claim(engine, "w-ticks", 30, kinds=["train"]).id == run.job_id
    events.append_many(engine, run.job_id, [
        ("metric", {"step": s, "total_steps": len(losses), "loss": v})
        for s, v in enumerate(losses, start=1)])
    assert queue.finish(engine, run.job_id, "w-ticks", {"steps": len(losses)})
    return run.id


def _axes(page, chart: str) -> dict[str, list[str]]:  # noqa: F811
    return page.evaluate(f"() => {{ const c = {chart}; return {{ x: c.scales.x.ticks.map(t => t.label),"
                         " y: c.scales.y.ticks.map(t => t.label) }; }")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_compare_and_run_page_axes(page, client, engine):  # noqa: F811
    a = _run_with_losses(client, engine, [22.31, 22.24], "close")
    b = _run_with_losses(client, engine, [22.29, 22.26], "closer")
    page.goto(f"{page.base}/runs/compare?a={a}&b={b}")
    page.wait_for_function("window.compareChart && window.compareChart.scales.y.ticks.length > 1")
    for chart in ("window.compareChart", "Chart.getChart('loss-chart')"):
        if chart != "window.compareChart":
            page.goto(f"{page.base}/runs/{a}")
            page.wait_for_function(f"{chart} && {chart}.data.datasets[0].data.length === 2")
        axes = _axes(page, chart)
        assert axes["x"] == ["1", "2"], (chart, axes)
        y = axes["y"]
        assert len(y) >= 3 and all(p != q for p, q in zip(y, y[1:])), (chart, y)
        assert all(len(label.split(".")[1]) == 2 for label in y), (chart, y)  # 22.24, not 22.2
