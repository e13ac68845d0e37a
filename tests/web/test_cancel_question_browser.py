"""The run page's Cancel asks its question when clicked (static/app.js, htmx:confirm with
data-confirm-url), in a real headless Chromium: a page loaded while the run was queued, clicked
after the run trained 13 steps, says step 13 is done; dismissing it cancels nothing."""
from __future__ import annotations

import pytest

from app.store import events, queue
from app.store.schema import JobState
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture
from tests.web.test_web_exports import _queued_run

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]


def test_cancel_asks_what_a_cancel_keeps_now(page, client, engine):  # noqa: F811
    run_id = _queued_run(client, engine)
    page.goto(f"{page.base}/runs/{run_id}")  # drawn while queued
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    events.append_many(engine, job.id, [("metric", {"step": 13, "total_steps": 40, "loss": 4.0})])
    asked = []

    def answer(dialog):
        asked.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", answer)
    page.click("#controls button.danger")
    for _ in range(150):  # the question is fetched first, then asked
        if asked:
            break
        page.wait_for_timeout(100)
    assert len(asked) == 1 and "(step 13 is done)" in asked[0], asked
    assert queue.get_job(engine, job.id).cancel_requested is False
    assert queue.get_job(engine, job.id).state == JobState.RUNNING
