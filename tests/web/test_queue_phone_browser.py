"""The queue and dashboard tables at phone width (390 px), and the run page's queue note leaving
with the queued state, in a real headless Chromium (Debian's package) against the served app."""
from __future__ import annotations

import pytest

from app.store import queue, workers
from app.store.admission import Slot
from tests.web.test_queue_run_ux import _runs
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]

LONG = "tiny-stories-lora-r16-alpha32-lr3e-4-cosine-warmup-0.03-seq512-batch8"
#: Counts the page's EventSource streams that have opened (window.openStreams), so a test waits
#: for the live stream instead of sleeping until it probably is
OPEN_STREAMS = """window.openStreams = 0;
window.EventSource = class extends window.EventSource {
  constructor(...args) {
    super(...args);
    this.addEventListener("open", () => { window.openStreams += 1; });
  }
};"""


def _no_horizontal_overflow(pg) -> None:
    widths = pg.evaluate("() => [document.documentElement.scrollWidth, document.body.scrollWidth,"
                         " window.innerWidth]")
    assert widths[0] <= widths[2] and widths[1] <= widths[2], widths


def _within(pg, selector: str, width: int = 390) -> None:
    """Every element ``selector`` matches is on screen horizontally, nothing scrolled away."""
    boxes = pg.locator(selector).evaluate_all(
        "els => els.map(e => { const r = e.getBoundingClientRect();"
        " return [r.left, r.right, r.height]; })")
    assert boxes, selector
    for left, right, _ in boxes:
        assert 0 <= left and right <= width + 0.5, (selector, left, right)
    return boxes


def test_queue_and_dashboard_fit_a_phone(page, client, engine, tmp_path):  # noqa: F811
    admin_id = client.get("/api/me").json()["id"]
    # a GPU too small for any job: every run waits, each with its reason and start
    workers.register(engine, "box-gpu0", "box", 1, "cuda:0 NVIDIA test", 24.0, 0, 0.3)
    _runs(client, engine, admin_id, [LONG, LONG + "-b", "short"])
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{page.base}/queue")
    page.screenshot(path=str(tmp_path / "phone-queue.png"), full_page=True)
    _no_horizontal_overflow(page)
    # by column, as the trial met them: 2 job, 4 needs, 5 why it waits, 6 estimated start
    waiting = "section.card:has(> h2:text-is('Waiting')) tbody"
    for column in (2, 4, 5, 6):
        assert len(_within(page, f"{waiting} td:nth-child({column})")) == 3, column
    # a row is a compact card, not a tall narrow column
    heights = page.locator(f"{waiting} tr").evaluate_all(
        "els => els.map(e => e.getBoundingClientRect().height)")
    assert max(heights) < 270, heights
    label = page.locator(f"{waiting} td:nth-child(6)").first.evaluate(
        "e => getComputedStyle(e, '::before').content")
    assert label == '"Estimated start"'  # the cell is labelled by its column
    page.goto(f"{page.base}/")
    page.screenshot(path=str(tmp_path / "phone-dashboard.png"), full_page=True)
    _no_horizontal_overflow(page)
    for column in (1, 5, 8):  # run, state, created (an admin's table has Owner second)
        _within(page, f"#runs tbody td:nth-child({column})")
    for column in (4, 5, 6):  # state (and outcome), queue position, for
        _within(page, f"#jobs tbody td:nth-child({column})")


def test_run_page_queue_note_leaves_with_the_queued_state(page, client, engine):  # noqa: F811
    from playwright.sync_api import expect

    admin_id = client.get("/api/me").json()["id"]
    slot = Slot("box-gpu0", "box", 0, 22.0, 24.0)
    workers.register(engine, slot.id, slot.host, 1, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    run_id = _runs(client, engine, admin_id, ["claimed while watched"])[0]
    page.add_init_script(OPEN_STREAMS)
    page.goto(f"{page.base}/runs/{run_id}")
    expect(page.locator("#place")).to_contain_text("1st in the queue")
    page.wait_for_function("window.openStreams > 0")  # the live stream is open
    assert queue.admit(engine, slot, 300, ["train"], 0.25, 24.0) is not None
    # the stream's state event flips the badge; the note goes with it, before the 5 s poll
    expect(page.locator("#m-state")).to_have_text("running", timeout=4000)
    expect(page.locator("#place")).not_to_contain_text("in the queue", timeout=500)
