"""The cancel confirmation says what a cancel keeps now (the trial's run promised kept
checkpoints at step 19 of a run that saves every 50 steps, and had nothing to export)."""
from __future__ import annotations

from app.store import events, queue, repo
from app.store.schema import Artifact
from app.studio import resume
from tests.web.test_web_exports import _queued_run


def _confirm(client, run_id: str) -> str:
    html = client.get(f"/runs/{run_id}").text
    return html.split('hx-confirm="', 1)[1].split('"', 1)[0]


def _checkpoints(engine, run_id: str, job_id: int, root, *steps: int) -> None:
    """Record checkpoint folders (an adapter config each) of ``steps`` under ``root``."""
    for step in steps:
        folder = root / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        repo.add_artifact(engine, Artifact(run_id=run_id, job_id=job_id, kind="checkpoint",
                                           path=str(folder), bytes=1, name=folder.name,
                                           meta={"step": step}))


def test_the_confirmation_follows_the_runs_progress(client, engine, tmp_path):
    run_id = _queued_run(client, engine)
    assert _confirm(client, run_id) == ("Cancel this queued run? It has not started: it simply "
                                        "leaves the queue, and nothing is trained or kept.")
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    assert "saves no checkpoint. Nothing is kept" in _confirm(client, run_id)
    events.append_many(engine, job.id, [("metric", {"step": 19, "total_steps": 40, "loss": 4.0})])
    assert _confirm(client, run_id) == (
        "Cancel this run? Training stops within a step or two (step 19 is done) and saves a "
        "checkpoint where it stops; the run can then be resumed or exported from it. If its last "
        "step comes first, the run finishes instead.")
    _checkpoints(engine, run_id, job.id, tmp_path, 5, 10)  # a resumed run's earlier ones stay
    assert _confirm(client, run_id).endswith(
        "the run finishes instead. The 2 checkpoints saved so far (newest at step 10) are kept.")
    queue.cancel(engine, job.id)
    queue.acknowledge_cancel(engine, job.id, "w-test")
    run, job = repo.run_with_job(engine, run_id)
    assert resume.cancel_outcome(engine, run, job, 19) is None  # ended: nothing to cancel


def test_the_question_is_asked_when_cancel_is_clicked(client, engine):
    """A page loaded while the run was queued asks, on click, what a cancel keeps *now* (the
    trial's dialog still said "nothing is trained" at step 13): GET /runs/{id}/cancel-question."""
    run_id = _queued_run(client, engine)
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    events.append_many(engine, job.id, [("metric", {"step": 13, "total_steps": 40, "loss": 4.0})])
    r = client.get(f"/runs/{run_id}/cancel-question")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "(step 13 is done)" in r.text
    assert client.get("/runs/ftjob-nope/cancel-question").status_code == 404
    queue.cancel(engine, job.id)
    queue.acknowledge_cancel(engine, job.id, "w-test")
    assert client.get(f"/runs/{run_id}/cancel-question").text == (
        "This run has ended; there is nothing to cancel.")


def test_a_run_cancelled_while_queued_says_it_never_started(client, engine):
    """Trial: a run cancelled in the queue was said to be "cancelled before it saved a
    checkpoint (one is saved every save_steps = 10 steps)"; it never started."""
    run_id = _queued_run(client, engine)
    assert "it simply leaves the queue" in client.get(f"/runs/{run_id}/cancel-question").text
    assert client.post(f"/api/runs/{run_id}/cancel").status_code == 200
    page = client.get(f"/runs/{run_id}").text
    assert f"Cannot resume: run {run_id} was cancelled before it started; clone it" in page
    assert "The run was cancelled before it started, so there is nothing to export." in page
    assert "The run was cancelled before it started, so it produced no adapter." in page
    assert "one is saved every" not in page and "before it saved" not in page
    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    assert r.status_code == 409
    assert r.json()["error"]["message"] == (f"run {run_id} was cancelled before it started; "
                                            "there is nothing to export")


def test_the_step_done_is_never_older_than_the_newest_checkpoint(client, engine, tmp_path):
    """Trial-break F10: the step metrics lag the checkpoint rows, and the question said "step 9
    is done" beside "newest at step 12"; both the page's confirm and the question on click name
    the newest of the two."""
    run_id = _queued_run(client, engine)
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    events.append_many(engine, job.id, [("metric", {"step": 9, "total_steps": 40, "loss": 4.0})])
    _checkpoints(engine, run_id, job.id, tmp_path, 10, 12)
    for said in (_confirm(client, run_id), client.get(f"/runs/{run_id}/cancel-question").text):
        assert "(step 12 is done)" in said and "step 9" not in said, said
        assert said.endswith("The 2 checkpoints saved so far (newest at step 12) are kept.")
    events.append_many(engine, job.id, [("metric", {"step": 14, "total_steps": 40, "loss": 3.9})])
    assert "(step 14 is done)" in client.get(f"/runs/{run_id}/cancel-question").text
