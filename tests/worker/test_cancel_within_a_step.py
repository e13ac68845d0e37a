"""A cancel stops training within a step or two, not at the next heartbeat (the trial's fast
run, cancelled at step 69, ran on to 80/80 and succeeded silently: the flag was read only every
heartbeat). The trainer reads the flag at each step's end, at most every CANCEL_POLL_SECONDS;
a cancel that arrives after the last step leaves the run finished and says so."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.settings import Settings
from app.store import events, queue, repo
from app.store.db import make_engine
from app.store.migrate import upgrade
from app.store.schema import Dataset, JobState
from app.store.specs import TrainSpec
from worker import context
from worker.context import JobContext
from tests.worker.test_cpu_lane import _wait
from worker.progress import Reporter

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (SHARED / "models" / "stories260K").exists(),
                                reason=f"no test data at {SHARED}")


def _store(tmp_path):
    url = f"sqlite:///{tmp_path / 'whetstone.db'}"
    upgrade(url)
    engine = make_engine(url)
    ds = repo.add_dataset(engine, Dataset(filename="identity_alpaca.json", format="alpaca",
                                          path=str(SHARED / "sft" / "identity_alpaca.json")))
    return url, engine, ds.id


def _claimed_ctx(tmp_path):
    """A running train job held by ``w-test`` (no heartbeat runs) and its JobContext."""
    _, engine, _ = _store(tmp_path)
    queue.enqueue(engine, "train", {"spec_version": 1, "run_id": "ftjob-x"})
    job = queue.claim(engine, "w-test", 60, kinds=["train"])
    return engine, JobContext(engine, Settings(data_dir=tmp_path), job, "w-test",
                              Reporter(engine, job.id))


@needs_data
def test_a_step_end_reads_the_flag_a_few_times_a_second(tmp_path, monkeypatch):
    engine, ctx = _claimed_ctx(tmp_path)
    now = [1000.0]  # the context's clock, moved by the test: exact on a loaded machine
    monkeypatch.setattr(context, "time", SimpleNamespace(monotonic=lambda: now[0]))
    reads = []
    real = queue.cancel_requested
    monkeypatch.setattr(queue, "cancel_requested",
                        lambda e, j: reads.append(now[0]) or real(e, j))
    for _ in range(500):  # a very fast run: 500 steps of 1 ms, half a second
        assert ctx.step_stop_reason() is None
        now[0] += 0.001
    # read at the first step, then once per CANCEL_POLL_SECONDS (0.2 s): 3 reads, not 500
    assert len(reads) == 3, reads
    assert all(b - a >= context.CANCEL_POLL_SECONDS for a, b in zip(reads, reads[1:])), reads
    queue.cancel(engine, ctx.job.id)  # no heartbeat ran: the step end alone sees it
    assert ctx.step_stop_reason() is None  # read less than CANCEL_POLL_SECONDS ago: not yet
    now[0] = reads[-1] + 1.001 * context.CANCEL_POLL_SECONDS  # (no float tie at the bound)
    assert ctx.step_stop_reason() == "cancelled" and len(reads) == 4
    assert ctx.step_stop_reason() == "cancelled" and len(reads) == 4  # seen: no more reads


@needs_data
def test_a_cancel_after_the_last_step_leaves_the_run_finished_and_says_so(tmp_path):
    from transformers import TrainerControl, TrainerState

    from worker.engine.callbacks import stopping_callback

    engine, ctx = _claimed_ctx(tmp_path)
    cb = stopping_callback()(ctx.step_stop_reason)
    queue.cancel(engine, ctx.job.id)  # the first step end reads the flag at once
    # seen after step 80 of 80: nothing to stop, training ends on its own
    last = cb.on_step_end(None, TrainerState(global_step=80, max_steps=80), TrainerControl())
    assert not last.should_training_stop and not last.should_save and cb.stopped is None
    assert ctx.cancel_came_too_late(80, 80) is True
    ctx.check()  # the cancel no longer stops the job: it finishes
    assert ctx.cancel_came_too_late(80, 80) is True  # told once
    ctx.reporter.flush()
    told = [ev.data for ev in events.since(engine, ctx.job.id, types=["log"])
            if "cancel arrived" in ev.data.get("message", "")]
    assert told == [{"level": "warning", "message": "cancel arrived after the last step "
                     "(80 of 80); the run finished"}]
    # seen after step 69 of 80: it stops there and saves a checkpoint
    cb = stopping_callback()(lambda: "cancelled")
    mid = cb.on_step_end(None, TrainerState(global_step=69, max_steps=80), TrainerControl())
    assert mid.should_training_stop and mid.should_save and cb.stopped == "cancelled"


@needs_data
def test_training_ended_on_its_own_without_a_cancel_is_not_told(tmp_path):
    engine, ctx = _claimed_ctx(tmp_path)
    job = ctx.job
    assert ctx.cancel_came_too_late(10, 10) is False
    ctx.reporter.flush()
    assert events.since(engine, job.id, types=["log"]) == []


@pytest.mark.slow
@needs_data
def test_the_real_worker_stops_within_a_step_between_heartbeats(tmp_path):
    """The worker process with its heartbeat 10 minutes apart: only the step's own read can
    see the cancel; training stops, saves a checkpoint where it stopped and the job ends
    cancelled in seconds."""
    url, engine, ds = _store(tmp_path)
    env = {**os.environ, "WHETSTONE_DATA_DIR": str(tmp_path), "WHETSTONE_DATABASE_URL": url,
           "WHETSTONE_SEED_DIR": str(SHARED), "WHETSTONE_HEARTBEAT_SECONDS": "600",
           "WHETSTONE_LEASE_SECONDS": "1200", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--poll-interval", "0.2",
                             "--worker-id", "w-cancel"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "worker.log", "ab"))

    def wait(pred, timeout, what):
        return _wait(pred, timeout, what, proc)

    try:
        wait(lambda: any(m.name == "stories260K" and m.status == "ready"
                         for m in repo.list_models(engine)), 120, "stories260K")
        run, job = repo.create_run(engine, TrainSpec(
            model="stories260K", dataset=ds, max_steps=100_000, save_steps=100_000,
            max_seq_length=128, per_device_train_batch_size=1, logging_steps=1))
        at = wait(lambda: (lambda m: m.data["step"] if m and m.data["step"] >= 3 else None)(
            events.latest(engine, job.id, "metric")), 120, "step 3")
        t0 = time.monotonic()
        queue.cancel(engine, job.id)
        j = wait(lambda: (lambda j: j if j.state in JobState.FINAL else None)(
            queue.get_job(engine, job.id)), 15, "the cancel")
        took = time.monotonic() - t0
        # the heartbeat would see it after up to 600 s; the step's own read sees it at once
        # (the rest is the checkpoint and the job's end, on a busy 2-core machine)
        assert j.state == JobState.CANCELLED and took < 10, (j.state, took)
        stopped = [a.meta["step"] for a in repo.list_artifacts(engine, run.id, "checkpoint")]
        last = events.latest(engine, job.id, "metric").data["step"]
        assert len(stopped) == 1 and at <= stopped[0] == last, (at, stopped, last)
        logs = [ev.data["message"] for ev in events.since(engine, job.id, types=["log"])]
        assert "stopping training (cancelled)" in logs and "cancelled by request" in logs
        print(f"cancel at step {at}: stopped at step {last} after {took:.2f} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        engine.dispose()
