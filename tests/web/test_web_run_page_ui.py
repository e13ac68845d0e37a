"""The run page as a user meets it (issue 19): the export form is not reset while exports run,
the page follows a live finish, warnings show beside the stats, verification reads as words, an
export in progress has a Cancel button that asks first, and nothing is off-screen at phone
width. The worker is simulated through the store (claim, events, finish), the same channel it
uses; the UI checks drive a real headless Chromium.
"""
from __future__ import annotations

import time

import pytest

from app.store import events, queue, repo
from app.store.schema import Artifact
from app.store.specs import GGUF_TYPES
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture
from tests.web.test_web_exports import _finished_run, _queued_run

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")

Q4_VERIFICATION = {"passed": True, "checks": {"gguf_Q4_K_M": {
    "passed": True, "type": "Q4_K_M", "exact_greedy_required": False, "top1_agreement": 0.8438,
    "positions": 96, "probes": 3, "near_ties": [], "tensor_types": {"Q5_0": 6, "F32": 4},
    "note": "Q4_K_M stored as Q5_0 (rows too short for K-quants)", "failures": []}}}
Q8_VERIFICATION = {"passed": True, "checks": {"gguf_Q8_0": {
    "passed": True, "type": "Q8_0", "exact_greedy_required": True, "top1_agreement": 0.9688,
    "positions": 96, "probes": 3, "near_ties": [{"check": "greedy", "prompt": "Once",
                                                 "position": 7, "margin": 0.0031, "limit": 0.05}],
    "failures": []}}}


def _succeeded_export(engine, run_id: str, verification: dict, settings=None) -> int:
    """Queue, claim and finish a GGUF export of ``run_id`` with ``verification`` and one file."""
    job = queue.enqueue(engine, "export", {"run_id": run_id, "format": "gguf",
                                           "quantization": ["Q4_K_M"]}, run_id=run_id)
    assert queue.claim(engine, "w-export", 30, kinds=["export"]).id == job.id
    repo.add_artifact(engine, Artifact(
        run_id=run_id, job_id=job.id, kind="gguf", path="/nonexistent/x.gguf", bytes=123456,
        name="a-rather-long-run-name-for-a-phone-screen-ftjob-0123456789abcdef-Q4_K_M.gguf",
        sha256="ab" * 32, meta={"export_id": f"export-{job.id}"}))
    assert queue.finish(engine, job.id, "w-export", {"verification": verification})
    return job.id


def test_verification_reads_as_a_summary_with_the_json_behind_a_toggle(client, engine):
    run_id = _finished_run(client, engine)
    _succeeded_export(engine, run_id, Q4_VERIFICATION)
    _succeeded_export(engine, run_id, Q8_VERIFICATION)
    frag = client.get(f"/runs/{run_id}/exports", headers={"HX-Request": "true"}).text
    assert ("GGUF Q4_K_M, reloaded with llama.cpp — passed: top-1 agreement 84% over 96 token "
            "positions on 3 probe prompts, reported only: a Q4_K_M file need not reproduce the "
            "trained model&#39;s greedy tokens, so no agreement threshold applies.") in frag
    assert ("GGUF Q8_0, reloaded with llama.cpp — passed: greedy tokens on 3 probe prompts must "
            "equal the trained model&#39;s: they do; 1 divergence accepted as near ties (logit "
            "margin 0.0031 within the limit 0.05), which requires top-1 agreement of at least "
            "90%; top-1 agreement 97% over 96 token positions.") in frag
    # the raw figures stay available, folded away
    assert "<summary class=\"small\">raw JSON</summary>" in frag and '"near_ties": [' in frag


def test_the_summary_uses_the_workers_thresholds():
    from app.studio import verification
    from worker.export import verify

    assert verification.NEAR_TIE_MIN_AGREEMENT == verify.MIN_AGREEMENT
    assert verification.EXACT_GGUF == verify.EXACT_GGUF


def test_export_form_offers_every_type_the_api_accepts(client, engine):
    run_id = _finished_run(client, engine)
    html = client.get(f"/runs/{run_id}").text
    offered = [chunk.split('"', 1)[0] for chunk in html.split('name="quantization" value="')[1:]]
    assert offered == list(GGUF_TYPES) and len(offered) == 20


def test_polling_refreshes_only_the_export_list(client, engine):
    run_id = _finished_run(client, engine)
    client.post(f"/api/runs/{run_id}/exports", json={"format": "gguf", "quantization": ["Q8_0"]})
    page_html = client.get(f"/runs/{run_id}").text
    form_at, list_at = page_html.index('id="export_form"'), page_html.index('id="export_list"')
    assert form_at < list_at and 'hx-trigger="every 2s"' in page_html[list_at:]
    assert 'hx-trigger="every 2s"' not in page_html[:list_at]
    polled = client.get(f"/runs/{run_id}/exports",
                        headers={"HX-Request": "true", "HX-Target": "export_list"}).text
    assert polled.startswith('<div id="export_list"') and "export_form" not in polled
    assert "queued" in polled


@pytest.mark.browser
@needs_chromium
def test_export_choices_survive_list_refreshes(page, client, engine):  # noqa: F811
    from playwright.sync_api import expect

    run_id = _finished_run(client, engine)
    client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})  # active: polled
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if r.url.endswith("/exports") else None)
    page.goto(f"{page.base}/runs/{run_id}")
    page.select_option("#export_form select[name=format]", "ollama")
    page.check("#export_form input[value=Q4_K_M]")
    page.uncheck("#export_form input[value=Q8_0]")
    deadline = time.time() + 15
    while len(polls) < 3 and time.time() < deadline:
        page.wait_for_timeout(500)
    assert len(polls) >= 3, polls  # the list was re-fetched more than twice meanwhile
    expect(page.locator("#export_form select[name=format]")).to_have_value("ollama")
    expect(page.locator("#export_form input[value=Q4_K_M]")).to_be_checked()
    expect(page.locator("#export_form input[value=Q8_0]")).not_to_be_checked()
    expect(page.locator("#export_form .export-dtype")).to_be_hidden()  # not for GGUF/Ollama
    page.click("#export_form button[type=submit]")
    expect(page.locator("#export_list tbody tr")).to_have_count(2)
    newest = repo.list_run_jobs(engine, run_id, "export")[0]
    assert newest.payload["format"] == "ollama" and newest.payload["quantization"] == ["Q4_K_M"]
    page.select_option("#export_form select[name=format]", "merged_16bit")
    expect(page.locator("#export_form .export-dtype")).to_be_visible()
    # Cancel beside a queued export asks first: dismissed, nothing happens; accepted, it ends
    # cancelled and its button gives way to Delete; the other export keeps its Cancel
    older = repo.list_run_jobs(engine, run_id, "export")[1]
    asked: list[str] = []
    page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
    page.click(f"#cancel-export-{newest.id}")
    page.wait_for_timeout(300)
    assert asked == [f"Cancel export {newest.id}? What it has written so far is removed."]
    assert queue.get_job(engine, newest.id).state == "queued"
    page.once("dialog", lambda d: (asked.append(d.message), d.accept()))
    page.click(f"#cancel-export-{newest.id}")
    expect(page.locator(f"#export-{newest.id} .state")).to_have_text("cancelled")
    expect(page.locator(f"#cancel-export-{newest.id}")).to_have_count(0)
    expect(page.locator(f"#cancel-export-{older.id}")).to_be_visible()
    assert queue.get_job(engine, newest.id).state == "cancelled" and len(asked) == 2


@pytest.mark.browser
@needs_chromium
def test_live_finish_shows_the_export_form_warnings_and_no_eta(page, client, engine):  # noqa: F811
    from playwright.sync_api import expect

    run_id = _queued_run(client, engine)
    page.goto(f"{page.base}/runs/{run_id}")
    expect(page.locator("#exports")).to_contain_text("available when training has succeeded")
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    events.append_many(engine, job.id, [
        ("log", {"level": "warning", "message": "44 rows are longer than max_seq_length 512"}),
        ("metric", {"step": 1, "total_steps": 2, "loss": 4.4, "eta_seconds": 1799}),
        ("log", {"level": "info", "message": "tokenizer: 100/999"}),
        ("log", {"level": "warning", "message": "the model has no chat template; using chatml"})])
    expect(page.locator("#m-eta")).to_have_text("29 min 59 s")
    box = page.locator("#run-warnings")
    expect(box).to_be_visible()
    expect(box.locator("li")).to_have_text(["44 rows are longer than max_seq_length 512",
                                            "the model has no chat template; using chatml"])
    # the step-1 loss is a visible point, not an empty chart
    radius = page.evaluate("() => Chart.getChart('loss-chart').getDatasetMeta(0).data[0].options.radius")
    assert radius > 0
    # the warnings box sits beside the stats, above the chart
    stats_box, chart_box = page.locator(".stats").first.bounding_box(), page.locator("#loss-chart").bounding_box()
    assert stats_box["y"] < box.bounding_box()["y"] < chart_box["y"]
    assert queue.finish(engine, job.id, "w-test", {"steps": 2})
    expect(page.locator("#m-state")).to_have_text("succeeded")
    expect(page.locator("#export_form")).to_be_visible()  # no reload
    expect(page.locator("#m-eta")).to_have_text("—")


def test_cancelled_run_shows_no_eta(client, engine):
    run_id = _queued_run(client, engine)
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    events.append_many(engine, job.id, [("metric", {"step": 1, "total_steps": 9, "loss": 4.0,
                                                    "eta_seconds": 1771})])
    assert client.get(f"/runs/{run_id}").text.count("29 min 31 s") == 1
    queue.cancel(engine, job.id)
    queue.acknowledge_cancel(engine, job.id, "w-test")
    html = client.get(f"/runs/{run_id}").text
    assert repo.run_with_job(engine, run_id)[1].state == "cancelled"
    assert "29 min 31 s" not in html and 'id="m-eta">—<' in html


def _no_horizontal_overflow(pg) -> None:
    widths = pg.evaluate("() => [document.documentElement.scrollWidth, document.body.scrollWidth,"
                         " window.innerWidth]")
    assert widths[0] <= widths[2] and widths[1] <= widths[2], widths


@pytest.mark.browser
@needs_chromium
def test_phone_width_run_page_exports_and_grpo_samples_fit(page, client, engine, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    page.set_viewport_size({"width": 390, "height": 844})
    run_id = _finished_run(client, engine)
    _succeeded_export(engine, run_id, Q4_VERIFICATION)
    _succeeded_export(engine, run_id, Q8_VERIFICATION)
    page.goto(f"{page.base}/runs/{run_id}")
    expect(page.locator("#exports tbody tr")).to_have_count(2)
    page.screenshot(path=str(tmp_path / "phone-exports.png"), full_page=True)
    _no_horizontal_overflow(page)
    card = page.locator("#exports").bounding_box()
    for sel in ("#export_form select[name=format]", "#export_form button[type=submit]",
                "#exports tbody td:nth-child(4) >> nth=0",
                "#exports tbody td:nth-child(5) >> nth=0"):
        box = page.locator(sel).bounding_box()
        assert box is not None, sel
        assert card["x"] <= box["x"] and box["x"] + box["width"] <= card["x"] + card["width"] + 0.5, sel
    assert page.locator("#export_form select[name=format]").bounding_box()["width"] > 250
    # a long value in a stat tile wraps inside its tile instead of running into the next one
    page.evaluate("() => { document.getElementById('m-mem').textContent = 'prompt_completion_prompt_completion'; }")
    assert page.evaluate("() => { const v = document.getElementById('m-mem');"
                         " return v.scrollWidth <= v.parentElement.clientWidth; }")

    from app.store.specs import GrpoSpec

    model = client.get("/api/models").json()["data"][0]["id"]
    grpo_run, _ = repo.create_run(engine, GrpoSpec(
        model=model, dataset=repo.get_run(engine, run_id).dataset_id, max_steps=4,
        rewards=[{"name": "numeric_match"}, {"name": "format"}]), kind="grpo")
    run = {"id": grpo_run.id}
    job = queue.claim(engine, "w-grpo", 30, kinds=["grpo"])
    assert job.run_id == run["id"]
    rows = [{"group": g, "prompt": "…" + "Natalia sold clips to 48 of her friends in April " * 6,
             "completion": "She sold 48/2 = 24 clips in May. " * 12,
             "rewards": {"numeric_match": 1.0, "format": 0.25}, "reward": 1.25,
             "advantage": 0.7071} for g in range(4)]
    events.append_many(engine, job.id, [("sample", {"step": 1, "rows": rows})])
    page.goto(f"{page.base}/runs/{run['id']}")
    expect(page.locator("#grpo-samples tbody tr")).to_have_count(4)
    expect(page.locator("#grpo-samples td:nth-child(7)").first).to_have_text("0.7071")
    _no_horizontal_overflow(page)
    table = page.locator("#grpo-samples").bounding_box()
    for column in (5, 6, 7):  # rewards, reward, advantage
        box = page.locator(f"#grpo-samples td:nth-child({column})").first.bounding_box()
        assert box["x"] + box["width"] <= table["x"] + table["width"] + 0.5 <= 390, column
    expect(page.locator("#grpo-samples td:nth-child(7)").first).to_have_attribute("data-label",
                                                                                   "advantage")
    page.screenshot(path=str(tmp_path / "phone-grpo.png"), full_page=True)
