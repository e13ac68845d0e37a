"""The run page's "Open in playground" link goes where the playground can chat (the trial's
cancelled run, with checkpoints 3 and 5, linked to its final adapter and got "has not finished
training"; a failed run with no checkpoint linked to nothing that could load)."""
from __future__ import annotations

import html
import re
from urllib.parse import unquote

from app.store import queue, repo
from tests.web.test_export_checkpoint import _checkpoint
from tests.web.test_web_exports import _queued_run


def _link(client, run_id: str) -> tuple[str, str] | None:
    """(the playground model the run page links to, the link's text), or None for no link."""
    m = re.search(r'<a id="open-playground" href="/playground\?model=([^"]+)">([^<]+)</a>',
                  client.get(f"/runs/{run_id}").text)
    return (unquote(html.unescape(m.group(1))), m.group(2)) if m else None


def _claimed(client, engine) -> tuple[str, int, str]:
    run_id = _queued_run(client, engine)
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    model = repo.get_model(engine, repo.get_run(engine, run_id).model_id).name
    return run_id, job.id, model


def test_a_cancelled_run_links_to_its_newest_checkpoint(client, engine, settings):
    run_id, job_id, model = _claimed(client, engine)
    assert _link(client, run_id) is None  # running: nothing to chat with yet
    for step in (3, 5):
        _checkpoint(engine, settings, run_id, job_id, step)
    queue.cancel(engine, job_id)
    assert queue.acknowledge_cancel(engine, job_id, "w-test")
    target = f"{model}:ft:{run_id}:checkpoint-5"
    assert _link(client, run_id) == (target, "Open checkpoint-5 in playground")
    page = client.get("/playground", params={"model": target}).text
    assert "has not finished training" not in page


def test_a_failed_run_without_a_checkpoint_has_no_link(client, engine):
    run_id, job_id, _ = _claimed(client, engine)
    assert queue.fail(engine, job_id, "w-test", "CUDA out of memory")
    assert _link(client, run_id) is None
    assert 'id="open-playground"' not in client.get(f"/runs/{run_id}").text


def test_a_succeeded_run_links_to_its_final_adapter(client, engine, settings):
    run_id, job_id, model = _claimed(client, engine)
    _checkpoint(engine, settings, run_id, job_id, 2)
    assert queue.finish(engine, job_id, "w-test", {"steps": 2})
    assert _link(client, run_id) == (f"{model}:ft:{run_id}", "Open in playground")
