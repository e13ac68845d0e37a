"""A run page watched while its run ends re-renders its header and every card from the server,
as a reload would: no Cancel button on a finished run, the measured memory peak, the generation
eval table, the playground link; a cancel in progress ends as a cancelled run's controls. The
worker is simulated through the store (claim, events, finish), the channel it uses."""
from __future__ import annotations

import pytest

from app.store import events, queue, repo
from app.store.specs import TrainSpec
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture
from tests.web.test_web_exports import _queued_run

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]

GENERATION = {"summary": {"samples": 1, "base_exact_match": 0.0, "fine_tuned_exact_match": 1.0,
                          "base_token_f1": 0.25, "fine_tuned_token_f1": 1.0},
              "rows": [{"row": 7, "prompt": "Say hi", "reference": "hi", "base": "hello",
                        "base_exact_match": False, "base_token_f1": 0.25, "fine_tuned": "hi",
                        "fine_tuned_exact_match": True, "fine_tuned_token_f1": 1.0}]}


def test_live_end_rerenders_the_header_and_every_card(page, client, engine):  # noqa: F811
    from playwright.sync_api import expect

    base_run = repo.get_run(engine, _queued_run(client, engine))
    run, _ = repo.create_run(engine, TrainSpec(model=base_run.model_id, dataset=base_run.dataset_id,
                                               max_steps=2, validation_split_percentage=10))
    queue.cancel(engine, repo.run_with_job(engine, base_run.id)[1].id)  # only `run` is queued
    page.goto(f"{page.base}/runs/{run.id}")
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    assert job.run_id == run.id
    events.append_many(engine, job.id, [("metric", {"step": 1, "total_steps": 2, "loss": 4.4,
                                                    "memory_gib": 0.7, "memory_kind": "rss",
                                                    "peak_gib": 0.75})])
    expect(page.locator("#m-step")).to_have_text("1 / 2")
    events.append_many(engine, job.id, [("log", {  # worker.engine.data.dropped_note's shape
        "level": "warning", "message": "3 rows with no trained token left out of training (rows "
        "4, 5, 6); row 4: too long", "details": ["row 4: too long", "row 5: too long",
                                                 "row 6: too long"]})])
    warning = page.locator("#run-warnings li")
    expect(warning).to_have_count(1)
    expect(warning.locator("summary")).to_have_text("show all 3")
    expect(warning.locator("details pre")).to_be_hidden()  # folded away until asked for
    warning.locator("summary").click()
    expect(warning.locator("details pre")).to_have_text("row 4: too long\nrow 5: too long\n"
                                                        "row 6: too long")
    page.reload()  # the memory card's "so far" is rendered by the server
    expect(page.locator("#run-memory")).to_contain_text("0.75 GiB so far")
    expect(page.locator("#run-memory h2")).to_have_text("Memory (CPU worker)")  # no CUDA talk
    expect(page.locator("#run-memory")).not_to_contain_text("CUDA context")
    confirm = page.locator("#controls form[hx-post$='/cancel']").get_attribute("hx-confirm")
    assert confirm.startswith("Cancel this run? Training stops within a step or two (step 1 ")
    expect(page.locator("#controls button.danger")).to_have_text("Cancel")
    assert queue.finish(engine, job.id, "w-test", {
        "steps": 2, "memory_peak": {"peak_gib": 0.8125, "kind": "rss"},
        "eval": {"rows": 1, "training_rows": 9}, "generation_eval": GENERATION})
    expect(page.locator("#m-state")).to_have_text("succeeded")
    expect(page.locator("#controls #delete-run")).to_be_visible()  # no reload
    expect(page.locator("#controls button:has-text('Cancel')")).to_have_count(0)
    expect(page.locator("#run-memory")).to_contain_text("0.81 GiB")
    expect(page.locator("#run-memory")).not_to_contain_text("so far")
    expect(page.locator("#generation-eval tbody tr")).to_have_count(1)
    expect(page.locator("#open-playground")).to_be_visible()
    expect(page.locator("#export_form")).to_be_visible()
    # htmx works in the new parts: the Delete form still posts through htmx (asks first)
    assert page.locator("#controls form[hx-post$='/delete']").count() == 1


def test_a_cancel_in_progress_ends_as_a_cancelled_runs_controls(page, client, engine):  # noqa: F811
    from playwright.sync_api import expect

    run_id = _queued_run(client, engine)
    page.goto(f"{page.base}/runs/{run_id}")
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    asked: list[str] = []
    page.on("dialog", lambda d: (asked.append(d.message), d.accept()))
    page.reload()  # now running, before its first step
    page.click("#controls button:has-text('Cancel')")
    expect(page.locator("#controls button.danger")).to_have_text("Cancelling…")
    assert asked == ["Cancel this run? It has not finished a training step yet, so cancelling "
                     "now saves no checkpoint. Nothing is kept: the run cannot be resumed or "
                     "exported, only cloned."]
    assert queue.acknowledge_cancel(engine, job.id, "w-test")
    expect(page.locator("#m-state")).to_have_text("cancelled")
    expect(page.locator("#controls button:has-text('Cancel')")).to_have_count(0)
    expect(page.locator("#controls")).to_contain_text("Cannot resume")
    expect(page.locator("#artifacts")).to_contain_text("cancelled before it finished")
