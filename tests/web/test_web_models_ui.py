"""The Models page (issue 19 item 14): the list refreshes after "Register", a failed import shows
its whole error and a Retry (owner or admin), and the chat template is not claimed before the
import has read it. The worker is simulated through the store (claim, update, fail)."""
from __future__ import annotations

import pytest

from app.store import queue, repo
from app.studio import accounts
from tests.web.conftest import signed_in
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

LONG_ERROR = ("could not download config.json from the Hugging Face Hub repo Qwen/Qwen2.5-0.5B-"
              "Instruct (is this machine offline? set WHETSTONE_SEED_DIR to a local copy): "
              + "connection refused; " * 20 + "END-OF-ERROR")


def _fail_import(engine, model_id: str) -> None:
    job = queue.claim(engine, "w-import", 30, kinds=["import_model"])
    while job is not None and job.payload["model_id"] != model_id:
        queue.finish(engine, job.id, "w-import", {})
        job = queue.claim(engine, "w-import", 30, kinds=["import_model"])
    repo.update_model(engine, model_id, status="failed", error=LONG_ERROR)
    assert queue.fail(engine, job.id, "w-import", LONG_ERROR)


def test_failed_import_shows_its_whole_error_and_retries(client, engine, app):
    r = client.post("/models", data={"source": "hf", "hf_id": "Qwen/Qwen2.5-0.5B-Instruct"},
                    follow_redirects=False)
    assert r.status_code == 303
    model = repo.get_model(engine, "Qwen2.5-0.5B-Instruct")
    html = client.get("/models").text
    row = html[html.index("Qwen2.5-0.5B-Instruct</strong>"):]
    row = row[:row.index("</tr>")]
    assert "known once imported" in row and "none (a default" not in row
    _fail_import(engine, model.id)
    html = client.get("/models").text
    row = html[html.index("Qwen2.5-0.5B-Instruct</strong>"):]
    row = row[:row.index("</tr>")]
    assert "END-OF-ERROR" in row and "clamp" not in row
    assert f'hx-post="/models/{model.id}/retry"' in row and ">Retry</button>" in row
    # a member may not retry someone else's import (it answers like a missing model)
    accounts.create_user(engine, "bob", "bob-password-1")
    with signed_in(app, "bob", "bob-password-1") as bob:
        assert bob.post(f"/models/{model.id}/retry").status_code == 404
    r = client.post(f"/models/{model.id}/retry", headers={"HX-Request": "true"})
    assert r.status_code == 200 and "Importing Qwen2.5-0.5B-Instruct again." in r.text
    again = repo.get_model(engine, model.id)
    assert again.status == "pending" and again.error is None
    queued = [j for j in queue.list_jobs(engine, state="queued") if j.kind == "import_model"]
    assert [j.payload["model_id"] for j in queued] == [model.id]
    r = client.post(f"/models/{model.id}/retry", headers={"HX-Request": "true"})
    assert r.status_code == 409 and "only a failed import can be retried" in r.text


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_the_list_shows_a_registered_model_without_a_reload(page, app):  # noqa: F811
    from playwright.sync_api import expect

    engine = app.state.engine
    for m in repo.list_models(engine):  # nothing pending: the list is not polled
        repo.update_model(engine, m.id, status="ready")
    page.goto(f"{page.base}/models")
    page.fill("#register_form input[name=hf_id]", "someone/tiny-model")
    page.click("#register_form button[type=submit]")
    expect(page.locator("#register_form .alert.ok")).to_contain_text("Registered tiny-model")
    row = page.locator("#model_list tr", has_text="tiny-model")
    expect(row).to_contain_text("pending")
    expect(row).to_contain_text("known once imported")
