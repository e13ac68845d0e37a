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
    assert 'Training time: <strong data-tick="125.5">2 min 05 s</strong> so far' in page
    # trial defect: at step 8 of attempt 2 the time was attempt 1's alone; the running
    # attempt counts from its step metric events (steps 5..8 logged, 10 s apart: 40 s for 4
    # steps since step 4). Events copied from attempt 1 are older than job 2's start.
    started = queue.get_job(engine, job2).started_at
    for i, step in enumerate((6, 8)):
        events.append_many(engine, job2, [("metric", {"step": step, "total_steps": 10,
                                                      "loss": 1.0, "eta_seconds": 20.0})])
        _set_ts(engine, job2, started + 5 + 20 * i)
    _shows(client, run_id, (40.0, 165.5, True),
           '<strong data-tick="165.5">2 min 45 s</strong> over all 2 attempts (this attempt '
           '<span data-tick="40.0">40 s</span>) so far</p>')
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


def _date_claims(engine, job_id: int, times: list[float]) -> None:
    """Date the job's ``running`` state events (its claims, oldest first) ``times``."""
    with session_scope(engine) as s:
        evs = [e for e in s.exec(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "state")
                                 .order_by(JobEvent.id)).all() if e.data.get("state") == JobState.RUNNING]
        for ev, ts in zip(evs, times):
            ev.ts = ts
            s.add(ev)


def _steps(engine, job_id: int, steps, t: float, every: float) -> None:
    for i, step in enumerate(steps):
        events.append_many(engine, job_id, [("metric", {"step": step, "total_steps": 300, "loss": 1.0})])
        _set_ts(engine, job_id, t + every * i)


def test_a_killed_attempt_counts_and_the_running_one_keeps_counting(client, engine):
    """Trial s21 F15: the training process was SIGKILLed after step 20 (it could record no
    segment), the job was requeued and resumed from checkpoint-20, then that attempt stopped at
    27 recording its segment (its supervisor was killed), and the third claim trains on: the
    training time counts the killed attempt from its step events (20 s), the recorded one (7 s)
    and the running one (16 s so far), not 7 s frozen; this attempt is the running one."""
    run_id, job = _running_run(client, engine)
    t0 = 1_700_000_000.0
    _steps(engine, job, range(1, 21), t0 + 1, 1.0)           # steps 1..20, 1 s each
    assert queue.reap(engine, restarted="w-test") == [(job, JobState.QUEUED)]
    assert queue.claim(engine, "w-test", 30, kinds=["train"]).id == job
    events.append_many(engine, job, [("log", {"message": "resuming from checkpoint-20", "resume_step": 20})])
    _set_ts(engine, job, t0 + 31)
    _steps(engine, job, range(21, 28), t0 + 32, 1.0)
    _segment(engine, job, 20, 27, 7.0)
    _set_ts(engine, job, t0 + 39)
    assert queue.reap(engine, restarted="w-test") == [(job, JobState.QUEUED)]
    assert queue.claim(engine, "w-test", 30, kinds=["train"]).id == job
    events.append_many(engine, job, [("log", {"message": "resuming from checkpoint-27", "resume_step": 27})])
    _set_ts(engine, job, t0 + 51)
    _steps(engine, job, range(28, 36), t0 + 52, 2.0)         # 7 intervals of 2 s for steps 28..35
    _date_claims(engine, job, [t0, t0 + 30, t0 + 50])
    tt = client.get(f"/api/runs/{run_id}").json()["training_time"]
    # 19 s between steps 1 and 20 scaled to 20 steps; 7 s recorded; 14 s for 7 intervals -> 8
    # steps. This attempt is the running one alone (trial s24 M-4: it summed the job's claims,
    # "43 s over all 3 attempts (this attempt 43 s)")
    assert tt == {"this_attempt": 16.0, "all_attempts": 43.0, "attempts": 3, "resumed": True, "running": True}
    assert ('Training time: <strong data-tick="43.0">43 s</strong> over all 3 attempts (this '
            'attempt <span data-tick="16.0">16 s</span>) so far</p>'
            in client.get(f"/runs/{run_id}").text)
