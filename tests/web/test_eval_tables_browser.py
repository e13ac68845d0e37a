"""Evaluation tables with long generated texts stay inside their card at a 1280 px window: the
run page's end-of-run and checkpoint eval tables and the compare page's side-by-side tables
(cells wrap anywhere and scroll past 10rem, the compare grid's columns may shrink). The worker
is simulated through the store (claim, metric events, finish with a result); the checks drive a
real headless Chromium."""
from __future__ import annotations

import os

import pytest

from app.store import queue, repo
from app.studio.checkpoint_eval import KIND
from tests.web.conftest import upload_sft
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]

WIDTH = 1280
LONG = "Once upon a time " * 150 + "x" * 3000   # words, then one unbreakable 3000-char run


def _gen(worker: str) -> dict:
    row = {"row": 1, "prompt": "Tell a story. " + "y" * 800, "reference": LONG,
           "base": LONG, "base_exact_match": False, "base_token_f1": 0.25,
           "fine_tuned": f"{worker}: {LONG}", "fine_tuned_exact_match": False,
           "fine_tuned_token_f1": 0.5}
    return {"summary": {"samples": 2, "base_exact_match": 0.0, "fine_tuned_exact_match": 0.0,
                        "base_token_f1": 0.25, "fine_tuned_token_f1": 0.5},
            "rows": [row, {**row, "row": 2}]}


def _run(client, engine, ds: str, worker: str) -> str:
    """A succeeded run with a held-out set, a long end-of-run generation eval and a succeeded
    checkpoint eval of step 2 with the same long texts."""
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 4,
                                       "validation_split_percentage": 10, "eval_steps": 2})
    assert r.status_code == 201, r.text
    run = repo.get_run(engine, r.json()["id"])
    assert queue.claim(engine, worker, 30, kinds=["train"]).id == run.job_id
    assert queue.finish(engine, run.job_id, worker, {"steps": 4, "generation_eval": _gen(worker)})
    ev = queue.enqueue(engine, KIND, {"spec_version": 1, "run_id": run.id, "checkpoint_step": 2,
                                      "samples": 2}, run_id=run.id, owner=run.owner)
    assert queue.claim(engine, worker, 30, kinds=[KIND]).id == ev.id
    assert queue.finish(engine, ev.id, worker, {"held_out": "10%", "generation_eval": _gen(worker)})
    return run.id


def _fits(pg, table_ids: list[str]) -> dict:
    """The page's scroll width and, per table, its box and its card's box (CSS px)."""
    return pg.evaluate("""(ids) => ({
        scroll: document.documentElement.scrollWidth, inner: window.innerWidth,
        tables: ids.map((id) => { const t = document.getElementById(id);
            const c = t.closest('.card').getBoundingClientRect(), b = t.getBoundingClientRect();
            return {id, left: b.left, right: b.right, cardLeft: c.left, cardRight: c.right}; })})""",
        table_ids)


def _check(got: dict) -> None:
    assert got["inner"] == WIDTH and got["scroll"] <= WIDTH, got
    for t in got["tables"]:
        assert t["cardLeft"] <= t["left"] and t["right"] <= t["cardRight"], t


def test_eval_tables_stay_inside_their_cards_at_1280px(page, client, engine, tmp_path):  # noqa: F811
    ds = upload_sft(client)
    a, b = _run(client, engine, ds, "w-a"), _run(client, engine, ds, "w-b")
    shots = os.environ.get("WHETSTONE_SHOTS") or str(tmp_path)
    page.set_viewport_size({"width": WIDTH, "height": 900})

    page.goto(f"{page.base}/runs/{a}")
    ck = page.locator("table[id^='checkpoint-eval-table-']")
    assert ck.count() == 1 and "w-a: Once upon a time" in ck.inner_text()
    _check(_fits(page, ["generation-eval", ck.get_attribute("id")]))
    page.locator("#eval-card").screenshot(path=f"{shots}/run-eval-1280.png")

    page.goto(f"{page.base}/runs/compare?a={a}&b={b}")
    assert "w-b: Once upon a time" in page.locator("#generation-eval-b").inner_text()
    got = _fits(page, ["generation-eval-a", "generation-eval-b"])
    _check(got)
    assert got["tables"][0]["right"] <= got["tables"][1]["left"]  # side by side, not overlapping
    page.screenshot(path=f"{shots}/compare-1280.png", full_page=True)
