"""Resume over HTTP (issue 16): when a run may be resumed and what a resume writes. The worker
is simulated through the store (claim, checkpoint artifacts, metric events, cancel), the channel
it uses; tests/worker/test_resume_run.py trains for real and checks the resumed run is exact."""
from __future__ import annotations

from app.store import events, queue, repo
from app.store.schema import JobState
from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in
from tests.web.test_export_checkpoint import _cancel, _checkpoint, _running_run


def test_resume_refusals_and_the_new_job(app, client, engine, settings):
    run_id, job_id = _running_run(client, engine)
    r = client.post(f"/api/runs/{run_id}/resume")
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "not_resumable"
    assert "is running: its job is still active" in r.json()["error"]["message"]
    assert 'id="resume-form"' not in client.get(f"/runs/{run_id}").text

    events.append_many(engine, job_id, [("metric", {"step": s, "loss": 5.0 - s / 10,
                                                    "learning_rate": 1e-3}) for s in range(1, 6)]
                       + [("log", {"level": "info", "message": "5 steps"})])
    _cancel(engine, job_id)
    r = client.post(f"/api/runs/{run_id}/resume")
    assert r.status_code == 409
    assert "was cancelled before it saved a checkpoint (one is saved every save_steps = 2 " \
           "steps)" in r.json()["error"]["message"]
    page = client.get(f"/runs/{run_id}").text
    assert 'id="resume-form"' not in page and "Cannot resume: run" in page

    _checkpoint(engine, settings, run_id, job_id, 2)
    _checkpoint(engine, settings, run_id, job_id, 4)
    page = client.get(f"/runs/{run_id}").text
    assert 'id="resume-form"' in page and "Resume from step 4" in page

    # another user's run is a 404, as if it did not exist
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    accounts.create_user(engine, "bea", "bea-password-1", actor=admin)
    with signed_in(app, "bea", "bea-password-1") as bea:
        r = bea.post(f"/api/runs/{run_id}/resume")
        assert r.status_code == 404 and queue.get_job(engine, job_id).state == JobState.CANCELLED

    r = client.post(f"/runs/{run_id}/resume", follow_redirects=False)  # the page's button
    assert r.status_code == 303 and r.headers["location"] == f"/runs/{run_id}"
    run = repo.get_run(engine, run_id)
    assert run.job_id != job_id
    new = queue.get_job(engine, run.job_id)
    assert (new.state, new.kind, new.payload, new.owner, new.run_id) == (
        JobState.QUEUED, "train", queue.get_job(engine, job_id).payload, run.owner, run_id)
    assert queue.get_job(engine, job_id).state == JobState.CANCELLED  # the first attempt's record
    # the new job carries the history up to its checkpoint; steps 5.. are trained again
    evs = events.since(engine, new.id)
    assert [e.data["step"] for e in evs if e.type == "metric"] == [1, 2, 3, 4]
    assert any(e.type == "log" and e.data["message"] == "5 steps" for e in evs)
    assert [e.data for e in evs if e.type == "state"] == [
        {"state": "queued", "reason": f"resumed from checkpoint-4 (job {job_id} cancelled)"}]
    api = client.get(f"/api/runs/{run_id}").json()
    assert api["state"] == "queued" and api["metrics"]
    r = client.post(f"/api/runs/{run_id}/resume")
    assert r.status_code == 409 and "is queued: its job is still active" in r.json()["error"][
        "message"]
