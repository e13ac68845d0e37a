"""The CPU lane of a real worker process: while a long training job runs on its main lane, a
model import and a dataset validation queued after it are claimed by the lane (worker id
``<id>-cpu``) and finish without waiting for the training; the dashboard's job list shows each
kind with its lane and queue position; SIGTERM hands both lanes' jobs back and exits 0."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from app.store import events, queue, repo, workers
from app.store.db import make_engine, session_scope
from app.store.migrate import upgrade
from app.store.schema import Dataset, JobState, Model, User
from app.store.specs import TrainSpec
from app.studio import jobs as jobs_uc
from app.studio import validation
from tests.conftest import SHARED_DATA as SHARED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SHARED / "models" / "stories260K").exists(),
                                 reason=f"no test data at {SHARED}")]


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (v := pred()):
            return v
        assert proc.poll() is None, f"worker exited ({proc.returncode}) waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _state(engine, job_id: int) -> str:
    return queue.get_job(engine, job_id).state


def test_import_and_validation_do_not_wait_for_training(tmp_path):
    url = f"sqlite:///{tmp_path / 'whetstone.db'}"
    env = {**os.environ, "WHETSTONE_DATA_DIR": str(tmp_path), "WHETSTONE_DATABASE_URL": url,
           "WHETSTONE_SEED_DIR": str(SHARED), "WHETSTONE_HEARTBEAT_SECONDS": "0.3",
           "WHETSTONE_LEASE_SECONDS": "20", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    upgrade(url)
    engine = make_engine(url)
    user = User(name="maker", password_hash="x", role="admin")
    with session_scope(engine) as s:
        s.add(user)
    train_ds = repo.add_dataset(engine, Dataset(filename="identity_alpaca.json", format="alpaca",
                                                path=str(SHARED / "sft" / "identity_alpaca.json")))
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--poll-interval", "0.2",
                             "--worker-id", "w-lane"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "ab"))
    try:
        _wait(lambda: (lambda m: m.status == "ready")(repo.get_model(engine, "stories260K"))
              if repo.list_models(engine) else None, 120, "the demo model", proc)
        assert sorted(w.id for w in workers.live(engine, 30)) == ["w-lane", "w-lane-cpu"]
        # a training run that would take many minutes
        run, train = repo.create_run(engine, TrainSpec(
            model="stories260K", dataset=train_ds.id, max_steps=100_000, max_seq_length=128,
            per_device_train_batch_size=1, logging_steps=1, r=4, lora_alpha=8))
        _wait(lambda: events.latest(engine, train.id, "metric"), 120, "training steps", proc)

        # queued after it: a real model import and a real dataset validation
        model = repo.add_model(engine, Model(
            name="stories-copy", source="llama2c",
            source_ref=f"{SHARED / 'models/stories260K/stories260K.bin'}|"
                       f"{SHARED / 'models/stories260K/tok512.bin'}"))
        upload = tmp_path / "uploads" / "alpaca.json"
        upload.parent.mkdir(exist_ok=True)
        shutil.copy(SHARED / "sft" / "alpaca_en_demo.json", upload)
        ds = validation.start(engine, user, "file-lane", upload, "alpaca.json",
                              upload.stat().st_size, "fine-tune", {"mode": "sft"})
        rows = {j.kind: j for j in jobs_uc.list_jobs(engine, user)}
        assert rows["train"].lane == "gpu" and rows["train"].state == "running"
        assert rows["validate_dataset"].lane == "cpu"

        t0 = time.monotonic()
        _wait(lambda: repo.get_model(engine, model.id).status == "ready", 120, "the import", proc)
        _wait(lambda: repo.get_dataset(engine, ds.id).status == "processed", 120,
              "the validation", proc)
        waited = time.monotonic() - t0
        assert _state(engine, train.id) == JobState.RUNNING  # training never stopped
        done = repo.get_dataset(engine, ds.id)
        assert done.rows == 999 and done.format == "alpaca"
        vjob = validation.job_id(done)
        claimed = [e.data for e in events.since(engine, vjob, types=["state"])
                   if e.data["state"] == "running"]
        assert claimed and claimed[0]["worker"] == "w-lane-cpu"
        progress = events.latest(engine, vjob, "progress").data
        assert progress["message"] == "validating 999 rows" and progress["done"] == 999
        print(f"import + validation done {waited:.1f} s after queueing, beside training")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        assert _state(engine, train.id) == JobState.QUEUED  # handed back for the next worker
    finally:
        if proc.poll() is None:
            proc.kill()
        engine.dispose()
