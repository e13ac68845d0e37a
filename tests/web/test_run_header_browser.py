"""The run page header (issue: its buttons wrapped onto ragged lines at 1280 and 1024 px): the
actions are one group beside the title that wraps as a group, every button on one baseline row
with the same gap, at desktop widths and at 800 px; a real headless Chromium measures it.

Set ``WHETSTONE_SHOTS`` to a folder to keep a screenshot per width."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.store import queue, repo
from app.store.specs import TrainSpec
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture
from tests.web.test_web_exports import _queued_run

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]

NAME = "alpaca-demo-lora-r16-lr2e-4-three-epochs"


def _failed_run(client, engine) -> str:
    """A failed run with a long name (its header offers Delete, Clone, Compare and says why it
    cannot resume)."""
    first = _queued_run(client, engine)
    spec = repo.get_run(engine, first).spec
    run, _ = repo.create_run(engine, TrainSpec(**{k: spec[k] for k in ("model", "dataset",
                                                                        "max_steps")}),
                             name=NAME, owner=client.get("/api/me").json()["id"])
    while (job := queue.claim(engine, "w-test", 30, kinds=["train"])) is not None:
        assert queue.fail(engine, job.id, "w-test", "CUDA error: out of memory")
    return run.id


def _boxes(page) -> list[dict]:
    return page.evaluate("""() => [...document.querySelectorAll(
        '#controls button, #controls a.button, #controls #resume-why')].map((e) => {
            const r = e.getBoundingClientRect();
            return {id: e.id || e.textContent.trim(), top: r.top, bottom: r.bottom,
                    left: r.left, right: r.right};
        })""")


def test_run_header_actions_line_up(page, client, engine):  # noqa: F811
    run_id = _failed_run(client, engine)
    page.goto(f"{page.base}/runs/{run_id}")
    page.wait_for_selector("#delete-run")
    for width in (1280, 1024, 800):
        page.set_viewport_size({"width": width, "height": 700})
        if os.environ.get("WHETSTONE_SHOTS"):
            page.screenshot(path=str(Path(os.environ["WHETSTONE_SHOTS"]) /
                                     f"run-head-{width}.png"),
                            clip={"x": 0, "y": 0, "width": width, "height": 260})
        *buttons, note = _boxes(page)
        assert [b["id"] for b in buttons] == ["delete-run", "clone-run", "compare-run"]
        assert note["id"] == "resume-why"
        # one row, the same gap between neighbours, inside the window
        assert {round(b["top"]) for b in buttons} == {round(buttons[0]["top"])}, (width, buttons)
        gaps = [round(b["left"] - a["right"]) for a, b in zip(buttons, buttons[1:])]
        assert gaps == [8, 8], (width, gaps)
        assert buttons[-1]["right"] <= width and note["right"] <= width
        # the note sits under the buttons, ending where they end
        assert note["top"] >= buttons[0]["bottom"] and abs(note["right"] - buttons[-1]["right"]) < 1
        h1 = page.locator(".run-head h1").bounding_box()
        if width >= 1024:  # side by side with the title
            assert buttons[0]["left"] >= h1["x"] + h1["width"] and buttons[0]["top"] < h1["y"] + h1["height"]
        else:  # the whole group moved under the title
            assert buttons[0]["top"] >= h1["y"] + h1["height"]
