"""Clone and compare in a real headless Chromium (issue 16): the run page's Clone opens the
form filled in, an edit and Start make a new run with that edit; Compare picks the other run
and draws both runs' training and eval loss on one chart. The worker is simulated through the
store (tests/web/test_run_compare.py: claim, metric events, finish)."""
from __future__ import annotations

import pytest

from app.store import repo
from tests.web.conftest import upload_sft
from tests.web.test_run_compare import _trained
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]


def test_clone_and_compare_in_the_browser(page, client, engine):  # noqa: F811
    from playwright.sync_api import expect

    ds = upload_sft(client)
    a = _trained(client, engine, ds, "w-a", 4, learning_rate=1e-3, r=8, name="first")

    page.goto(f"{page.base}/runs/{a}")
    page.click("#clone-run")
    expect(page.locator("#clone-of")).to_contain_text(a)
    expect(page.locator("#run_form input[name=name]")).to_have_value("first (copy)")
    expect(page.locator("#run_form input[name=r]")).to_have_value("8")
    page.fill("#run_form input[name=r]", "16")
    page.click("#run_form button[type=submit]")
    page.wait_for_url(lambda url: "/runs/ftjob-" in url and a not in url)
    b = page.url.rsplit("/", 1)[1]
    src, new = repo.get_run(engine, a).spec, repo.get_run(engine, b).spec
    assert {k for k in src if src[k] != new[k]} == {"r"} and new["r"] == 16

    page.goto(f"{page.base}/runs/{a}")
    page.click("#compare-run")
    page.select_option("#compare-form select[name=b]", b)
    page.click("#compare-form button[type=submit]")
    expect(page.locator("#config-diff")).to_contain_text("r")
    page.wait_for_function("window.compareChart && window.compareChart.data.datasets.length === 3")
    labels = page.evaluate("window.compareChart.data.datasets.map(d => [d.label, d.data.length])")
    assert labels == [["A first: training loss", 4], ["A first: eval loss", 3],
                      ["B first (copy): training loss", 0]]
    # A wider with round points under B's narrower line and triangles: identical curves (a clone
    # with the same seed) stay visible both (re-trial s22)
    styles = page.evaluate("window.compareChart.data.datasets.map(d => [d.borderWidth, d.pointStyle])")
    assert styles == [[4, "circle"], [4, "circle"], [2, "triangle"]]


def test_compare_draws_grpo_rewards_in_the_browser(page, client, engine):  # noqa: F811
    """A GRPO run beside an SFT run: the loss chart holds the SFT run only; the reward chart
    each GRPO step's mean reward overall and per function, the KL chart its KL."""
    from tests.web.test_run_compare import _grpo

    ds = upload_sft(client)
    sft = _trained(client, engine, ds, "w-s", 4, name="sft")
    grpo = _grpo(client, engine, "w-g", 5, [{"name": "numeric_match"},
                                           {"name": "format", "weight": 0.5}], name="grpo")
    page.goto(f"{page.base}/runs/compare?a={sft}&b={grpo}")
    page.wait_for_function("window.compareRewardChart && window.compareKlChart")
    series = "c => c.data.datasets.map(d => [d.label, d.data.length, (d.borderDash || []).length > 0])"
    assert page.evaluate(f"({series})(window.compareRewardChart)") == [
        ["B grpo: mean reward", 5, False], ["B grpo: format", 5, True],
        ["B grpo: numeric_match", 5, True]]
    assert page.evaluate(f"({series})(window.compareKlChart)") == [["B grpo: KL", 5, False]]
    assert page.evaluate(f"({series})(window.compareChart)") == [
        ["A sft: training loss", 4, False], ["A sft: eval loss", 3, True]]


def test_a_cancelled_run_page_follows_a_resume_made_elsewhere(page, client, engine):  # noqa: F811
    """Trial s22 F8: a cancelled run's page left open kept saying "cancelled · Resume from step
    N" for minutes after the run was resumed through the API (its Resume then answered "still
    active"). The open page now notices the run's new job and shows it."""
    from playwright.sync_api import expect

    from app.store import events, queue

    ds = upload_sft(client)
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 9})
    run = repo.get_run(engine, r.json()["id"])
    assert queue.claim(engine, "w-c", 30, kinds=["train"]).id == run.job_id
    events.append_many(engine, run.job_id, [("metric", {"step": s, "total_steps": 9,
                                                         "loss": 3.0 - s / 10})
                                            for s in (1, 2, 3)])
    queue.cancel(engine, run.job_id)
    assert queue.acknowledge_cancel(engine, run.job_id, "w-c")

    page.goto(f"{page.base}/runs/{run.id}")
    expect(page.locator("#m-state")).to_have_text("cancelled")
    assert page.locator("#run").get_attribute("data-job-id") == str(run.job_id)
    _, again = repo.resume_run(engine, run.id, 3, "resumed through the API")
    page.wait_for_function(f"document.getElementById('run') && "
                           f"document.getElementById('run').dataset.jobId === '{again.id}'",
                           timeout=20_000)
    expect(page.locator("#m-state")).to_have_text("queued")
