"""The queue's estimate before a training job has timed a step of its own (trial s21, F13): a
200-step run behind which others wait is not as long as the 5-step runs the box has seen, so the
estimate is its planned steps at the pace of those runs (seconds a step, seconds around the
training), per model, not the median duration of the kind."""
from __future__ import annotations

import math

from sqlmodel import select

from app.store import events, queue, repo, workers
from app.store.db import session_scope
from app.store.schema import Job, JobState, Model, now
from app.store.specs import TrainSpec
from app.studio import queue_pace
from tests.web.conftest import upload_sft
from tests.web.test_queue_cpu import CPU_SLOT


def _run(engine, model: str, ds: str, owner: str, **spec) -> Job:
    return repo.create_run(engine, TrainSpec(model=model, dataset=ds, **spec), owner=owner,
                           estimate_gib=0.6)[1]


def _claim(engine, job: Job) -> None:
    assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.1, 24.0).id == job.id


def _finish(engine, job: Job, seconds: float, steps: int, runtime: float,
            attempts: int = 1) -> None:
    with session_scope(engine) as s:
        row = s.get(Job, job.id)
        row.state, row.attempts = JobState.SUCCEEDED, attempts
        row.started_at, row.finished_at = now() - 2000, now() - 2000 + seconds
        row.result = {"steps": steps, "train_runtime": runtime}


def test_a_long_run_is_estimated_by_its_steps_not_the_median_run(client, engine) -> None:
    me = client.get("/api/me").json()["id"]
    with session_scope(engine) as s:  # the seeded demo model's import: done, out of the way
        for job in s.exec(select(Job).where(Job.state == JobState.QUEUED)):
            job.state = JobState.SUCCEEDED
    workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
    model = client.get("/api/models").json()["data"][0]["id"]
    ds = upload_sft(client, "alpaca_en_demo.json")
    rows = client.get(f"/api/datasets/{ds}").json()["rows"]
    # what the box has seen: two 5-step runs of 17 s and 19 s (1 s and 1.4 s a step, 12 s
    # around), a resumed one that must not count, and a 40 s job of another model
    for seconds, runtime, attempts in ((17, 5.0, 1), (19, 7.0, 1), (500, 5.0, 2)):
        job = _run(engine, model, ds, me, max_steps=5)
        _claim(engine, job)
        _finish(engine, job, seconds, 5, runtime, attempts)
    with session_scope(engine) as s:
        other = s.get(Model, model).model_copy(update={"id": "model-other", "name": "other"})
        s.add(Model(**other.model_dump()))
    job = _run(engine, "model-other", ds, me, max_steps=10)
    _claim(engine, job)
    _finish(engine, job, 40.0, 10, 30.0)

    long = _run(engine, model, ds, me, max_steps=200)
    _claim(engine, long)
    with session_scope(engine) as s:
        s.get(Job, long.id).started_at = now() - 10  # tokenising: no ETA metric yet
    short = _run(engine, model, ds, me, max_steps=5)
    epochs = _run(engine, model, ds, me, num_train_epochs=2, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, validation_split_percentage=0)
    packed = _run(engine, model, ds, me, packing=True)  # steps unknown before tokenising

    pace = 1.2, 12.0  # per model: medians of (1.0, 1.4) s a step and (12, 12) s around
    epoch_steps = math.ceil(2 * (math.ceil(rows / 4) // 2))
    ahead = pace[1] + 200 * pace[0] - 10
    expected = [ahead, ahead + pace[1] + 5 * pace[0],
                ahead + 2 * pace[1] + 5 * pace[0] + epoch_steps * pace[0]]
    data = client.get("/api/queue").json()
    (running,) = data["gpus"][0]["running"]
    assert abs(running["eta_seconds"] - ahead) < 2, running  # the median job said 8 s
    waiting = {w["job_id"]: w["start_in_seconds"] for w in data["waiting"]}
    got = [waiting[short.id], waiting[epochs.id], waiting[packed.id]]
    assert all(abs(g - e) < 2 for g, e in zip(got, expected)), (got, expected)

    # its own ETA, once it has timed steps, wins over the plan
    events.append_many(engine, long.id, [("metric", {"step": 20, "total_steps": 200,
                                                     "eta_seconds": 900.0})])
    (running,) = client.get("/api/queue").json()["gpus"][0]["running"]
    assert 895 <= running["eta_seconds"] <= 900


def test_pace_per_model_and_kind(client, engine) -> None:
    me = client.get("/api/me").json()["id"]
    model = client.get("/api/models").json()["data"][0]["id"]
    ds = upload_sft(client, "alpaca_en_demo.json")
    workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
    with session_scope(engine) as s:
        for job in s.exec(select(Job).where(Job.state == JobState.QUEUED)):
            job.state = JobState.SUCCEEDED
    with session_scope(engine) as s:
        assert queue_pace.paces(s, {"train", "export"}) == {}  # nothing succeeded yet
    job = _run(engine, model, ds, me, max_steps=4)
    _claim(engine, job)
    _finish(engine, job, 30.0, 4, 10.0)
    with session_scope(engine) as s:
        got = queue_pace.paces(s, {"train", "export"})
        assert {k: (p.per_step, round(p.overhead, 3)) for k, p in got.items()} == {
            ("train", model): (2.5, 20.0), ("train", None): (2.5, 20.0)}
        assert queue_pace.paces(s, {"train"}, on_gpu=True) == got  # the CPU slot is a slot
