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
