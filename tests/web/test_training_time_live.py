"""The run page's "Training time" follows the run while the page is open (trial: it stayed at the
value of the page load, or absent, until a reload). Its figures are the server's
(``app.studio.train_time``, from the logged steps): the page reads its line again from
``/runs/{id}/training-time`` when a step is logged (the live stream's metric events), and the
run's end brings the final value. The worker is simulated through the store (claim, events,
finish), the channel it uses; the live checks drive a real headless Chromium."""
from __future__ import annotations

import re
import time

import pytest

from app.store import events, queue
from app.store.db import session_scope
from app.store.schema import JobEvent
from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture
from tests.web.test_web_exports import _queued_run

BOX = '<div id="training-time-box">'


def _running(client, engine) -> tuple[str, int, float]:
    """A run whose job a (simulated) worker has started: (run id, job id, its started_at)."""
    run_id = _queued_run(client, engine)
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    return run_id, job.id, job.started_at


def _steps(engine, job_id: int, at: dict[int, float]) -> None:
    """Step metric events of ``job_id`` logged at ``{step: epoch seconds}``."""
    with session_scope(engine, immediate=True) as s:
        for step, ts in at.items():
            s.add(JobEvent(job_id=job_id, type="metric", ts=ts,
                           data={"step": step, "total_steps": 10, "loss": 1.0}))


def _finish(engine, job_id: int, seconds: float) -> None:
    """The worker records the attempt's segment and ends the job."""
    events.append_many(engine, job_id, [("log", {
        "level": "info", "message": f"trained in {seconds}s", "segment": {
            "job_id": job_id, "from_step": 0, "to_step": 10, "train_runtime": seconds}})])
    assert queue.finish(engine, job_id, "w-test", {"steps": 10, "train_runtime": seconds})


def test_the_fragment_is_the_pages_line(app, client, engine) -> None:
    run_id, job_id, started = _running(client, engine)
    empty = client.get(f"/runs/{run_id}/training-time")
    assert empty.status_code == 200 and empty.text == BOX + "</div>"
    assert BOX + "</div>" in client.get(f"/runs/{run_id}").text  # the page has the empty box
    # steps 1 and 3 logged 20 s apart: 3 steps took 30 s so far
    _steps(engine, job_id, {1: started + 1, 3: started + 21})
    line = (BOX + '<p class="small" id="training-time">Training time: <strong data-tick="30.0">'
            "30 s</strong> so far</p></div>")  # data-tick: the page counts on between steps
    assert client.get(f"/runs/{run_id}/training-time").text == line
    assert line in client.get(f"/runs/{run_id}").text
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    accounts.create_user(engine, "bea", "bea-password-1", actor=admin)
    with signed_in(app, "bea", "bea-password-1") as bea:  # another user's run: as if none
        assert bea.get(f"/runs/{run_id}/training-time").status_code == 404


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_training_time_follows_the_run_and_settles_at_its_end(page, client, engine):  # noqa: F811
    from playwright.sync_api import expect

    run_id, job_id, started = _running(client, engine)
    page.goto(f"{page.base}/runs/{run_id}")
    line = page.locator("#training-time")
    expect(page.locator("#m-state")).to_have_text("running")
    expect(line).to_have_count(0)  # nothing trained yet
    _steps(engine, job_id, {1: started + 1, 3: started + 21})
    expect(line).to_have_text(re.compile(r"Training time: 3\d s so far"))
    seconds = int(re.search(r"(\d+) s", line.inner_text()).group(1))
    time.sleep(3.5)  # trial s22 F13: between two steps the line counts on by itself
    assert int(re.search(r"(\d+) s", line.inner_text()).group(1)) >= seconds + 2
    _steps(engine, job_id, {5: started + 41})
    expect(line).to_have_text(re.compile(r"Training time: 5\d s so far"))
    _finish(engine, job_id, 75.0)
    expect(page.locator("#m-state")).to_have_text("succeeded")
    expect(line).to_have_text("Training time: 1 min 15 s")
    time.sleep(1.5)  # a read still under way when the run ended does not bring back "so far"
    expect(line).to_have_text("Training time: 1 min 15 s")
