"""A resumed run's training time is the sum over its attempts (trial defect: it showed only the
last attempt's ``train_runtime``). The worker records each attempt's segment as a log event
(worker.jobs.common.record_segment; tests/worker/test_resume_run.py drives the real one); here
the worker is simulated through the store, the channel it uses, as in test_run_resume."""
from __future__ import annotations

from sqlmodel import select

from app.store import events, queue, repo
from app.store.db import session_scope
from app.store.schema import JobEvent, JobState
from tests.web.test_export_checkpoint import _cancel, _checkpoint, _running_run


def _segment(engine, job_id: int, first: int, last: int, seconds: float) -> None:
    events.append_many(engine, job_id, [("log", {
        "level": "info", "message": f"trained steps {first + 1}-{last} in {seconds:.1f}s",
        "segment": {"job_id": job_id, "from_step": first, "to_step": last,
                    "train_runtime": seconds}})])


def _set_ts(engine, job_id: int, ts: float) -> None:
    """Date the job's newest event ``ts`` (as if the worker wrote it then)."""
    with session_scope(engine) as s:
        ev = s.exec(select(JobEvent).where(JobEvent.job_id == job_id)
                    .order_by(JobEvent.id.desc())).first()
        ev.ts = ts
        s.add(ev)


def _shows(client, run_id: str, want: tuple[float, float, bool], text: str) -> None:
    """The API's training_time of a resumed run is ``want`` (this attempt, all, running) and
    the run page says ``Training time: <text>``."""
    this, total, running = want
    assert client.get(f"/api/runs/{run_id}").json()["training_time"] == {
        "this_attempt": this, "all_attempts": total, "attempts": 2, "resumed": True,
        "running": running}
    assert f"Training time: {text}" in client.get(f"/runs/{run_id}").text


def test_resumed_run_counts_every_attempt(client, engine, settings):
    run_id, job1 = _running_run(client, engine)
    _segment(engine, job1, 0, 4, 125.5)
    _checkpoint(engine, settings, run_id, job1, 4)
    _cancel(engine, job1)
    r = client.get(f"/api/runs/{run_id}").json()
    assert r["training_time"] == {"this_attempt": 125.5, "all_attempts": 125.5, "attempts": 1,
                                  "resumed": False, "running": False}
    assert "Training time: <strong>2 min 05 s</strong></p>" in client.get(f"/runs/{run_id}").text

    assert client.post(f"/api/runs/{run_id}/resume").status_code == 200
    job2 = repo.get_run(engine, run_id).job_id
    assert job2 != job1 and queue.claim(engine, "w-test", 30, kinds=["train"]).id == job2
    page = client.get(f"/runs/{run_id}").text  # running, no step yet: the earlier attempt
    assert "Training time: <strong>2 min 05 s</strong> so far" in page
    # trial defect: at step 8 of attempt 2 the time was attempt 1's alone; the running
    # attempt counts from its step metric events (steps 5..8 logged, 10 s apart: 40 s for 4
    # steps since step 4). Events copied from attempt 1 are older than job 2's start.
    started = queue.get_job(engine, job2).started_at
    for i, step in enumerate((6, 8)):
        events.append_many(engine, job2, [("metric", {"step": step, "total_steps": 10,
                                                      "loss": 1.0, "eta_seconds": 20.0})])
        _set_ts(engine, job2, started + 5 + 20 * i)
    _shows(client, run_id, (40.0, 165.5, True),
           "<strong>2 min 45 s</strong> over all 2 attempts (this attempt 40 s) so far</p>")
    _segment(engine, job2, 4, 10, 60.25)
    queue.finish(engine, job2, "w-test", {"steps": 10, "train_runtime": 60.25,
                                          "final_loss": 1.0, "train_loss": 1.5})
    assert queue.get_job(engine, job2).state == JobState.SUCCEEDED

    _shows(client, run_id, (60.25, 185.75, False),
           "<strong>3 min 05 s</strong> over all 2 attempts (this attempt 1 min 00 s)</p>")
    other, _ = _running_run(client, engine)
    cmp = client.get(f"/api/runs/{run_id}/compare", params={"other": other})
    assert cmp.status_code == 200, cmp.text
    assert cmp.json()["a"]["result"]["train_runtime"] == 185.75


def test_run_finished_before_segments_were_recorded_shows_its_runtime(client, engine):
    run_id, job = _running_run(client, engine)
    queue.finish(engine, job, "w-test", {"steps": 10, "train_runtime": 42.0})
    assert client.get(f"/api/runs/{run_id}").json()["training_time"] == {
        "this_attempt": 42.0, "all_attempts": 42.0, "attempts": 1, "resumed": False, "running": False}
    fresh, _ = _running_run(client, engine)
    assert client.get(f"/api/runs/{fresh}").json()["training_time"] is None
    assert 'id="training-time"' not in client.get(f"/runs/{fresh}").text
