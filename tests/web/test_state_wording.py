"""A failed run's messages read as English: "failed before it saved a checkpoint", "(it
failed)", "The run failed: ..." (the trial read "was failed" and "(it is failed)")."""
from __future__ import annotations

from app.store import queue, repo
from app.store.schema import JobState
from app.studio.job_states import state_words
from tests.web.test_export_checkpoint import _checkpoint
from tests.web.test_web_exports import _queued_run


def test_state_words():
    assert [state_words(s) for s in (JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED,
                                     JobState.FAILED, JobState.CANCELLED, None)] == [
        "is queued", "is running", "succeeded", "failed", "was cancelled", "has no job"]


def test_a_failed_runs_messages(client, engine, settings):
    run_id = _queued_run(client, engine)
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    assert queue.fail(engine, job.id, "w-test", "CUDA out of memory")
    page = client.get(f"/runs/{run_id}").text
    assert f"Cannot resume: run {run_id} failed before it saved a checkpoint" in page
    assert "The run failed before it saved a checkpoint (one is saved every" in page
    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    assert r.status_code == 409
    assert f"run {run_id} failed before it saved a checkpoint" in r.json()["error"]["message"]
    model = repo.get_model(engine, repo.get_run(engine, run_id).model_id).name
    r = client.post("/api/playground/sessions", json={"model": f"{model}:ft:{run_id}"})
    assert r.status_code == 409
    assert "has not finished training (it failed)" in r.json()["error"]["message"]
    for page in (client.get(f"/runs/{run_id}").text, r.text):
        assert "was failed" not in page and "is failed" not in page
    _checkpoint(engine, settings, run_id, job.id, 4)
    assert ("The run failed: exports are made from its newest checkpoint, step 4."
            in client.get(f"/runs/{run_id}").text)
