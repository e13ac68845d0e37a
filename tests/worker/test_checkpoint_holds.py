"""A checkpoint a queued job still needs outlives ``save_total_limit`` (trial s24 M-3: a
Playground session opened on checkpoint 2 while the run trained on waited for the worker; by the
time it was admitted the trainer had removed checkpoint 2 and the session failed).

The real ``train`` job (stories260K on the CPU, an in-process worker loop, 5 steps, a checkpoint
every step, the trainer keeping 2) with a session opened over HTTP on checkpoint 2 right after
that save, its prompt sent while it waits: checkpoint 2 stays (the run log says why), the
session then loads it and answers, and once the session has ended the next rotation removes it.
"""
from __future__ import annotations

import json

import pytest

from app.store import events, queue, repo
from app.store.schema import JobState
from tests.conftest import SHARED_DATA, STORIES
from tests.worker.conftest import inline_studio
from worker import checkpoints

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(),
                                 reason=f"no test data at {SHARED_DATA}")]

SPEC = {"model": "stories260K", "max_steps": 5, "save_steps": 1, "logging_steps": 1,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "r": 4,
        "lora_alpha": 8, "max_seq_length": 96, "chat_template": "chatml", "seed": 3}


def test_a_checkpoint_a_waiting_session_uses_is_kept_until_the_session_ends(tmp_path,
                                                                           monkeypatch):
    rows = tmp_path / "identity8.json"
    rows.write_text(json.dumps(json.loads((SHARED_DATA / "sft" / "identity_alpaca.json")
                                          .read_text())[:8]))
    with inline_studio(tmp_path / "data", [rows], "w-holds", playground_idle_seconds=1.0,
                       playground_yield_seconds=0.0) as studio:
        c, w, engine = studio["client"], studio["worker"], studio["engine"]
        r = c.post("/api/runs", json={**SPEC, "dataset": studio["ids"][rows.name]})
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        model = f"stories260K:ft:{run_id}:checkpoint-2"
        opened = {}
        record = checkpoints.record

        def record_then_open(*args, **kw):  # the user opens a session as checkpoint 2 appears
            record(*args, **kw)
            if args[3] == 2:
                got = c.post("/api/playground/sessions", json={"model": model})
                assert got.status_code == 201, got.text
                opened.update(got.json())
                sent = c.post(f"/api/playground/sessions/{opened['id']}/prompts",
                              json={"messages": [{"role": "user", "content": "Who are you?"}],
                                    "temperature": 0, "max_tokens": 8})
                assert sent.status_code == 202, sent.text
                opened["request_id"] = sent.json()["request_id"]

        monkeypatch.setattr(checkpoints, "record", record_then_open)
        w.kinds = ["train"]  # the session waits while the run trains on
        w.serve(once=True)
        run, job = repo.run_with_job(engine, run_id)
        assert job.state == JobState.SUCCEEDED, job.error
        assert queue.get_job(engine, opened["id"]).state == JobState.QUEUED

        folder = tmp_path / "data" / "runs" / run_id / "checkpoints"
        assert sorted(p.name for p in folder.glob("checkpoint-*")) == \
            ["checkpoint-2", "checkpoint-4", "checkpoint-5"]  # 1 and 3 removed as before
        assert sorted(a.meta["step"] for a in repo.list_artifacts(engine, run_id, "checkpoint")) \
            == [2, 4, 5]
        logs = [e.data["message"] for e in events.since(engine, job.id, 0, 1000, types=["log"])]
        kept = [m for m in logs if m.startswith("checkpoint-2 is kept")]
        assert kept == [f"checkpoint-2 is kept past save_total_limit=2: Playground session "
                        f"{opened['id']} uses it (it is removed at the first save after that job "
                        "ends)"], logs  # said once, though it was kept at the saves of 4 and 5
        config = json.loads((tmp_path / "data" / "runs" / run_id / "config.json").read_text())
        assert config["training_arguments"]["save_total_limit"] == 2  # the run's limit, applied

        w.kinds = ["playground"]  # the slot frees: the session loads checkpoint 2 and answers
        w.serve(once=True)
        session = queue.get_job(engine, opened["id"])
        assert session.state == JobState.SUCCEEDED, session.error
        assert session.result["prompts"] == 1 and session.result["ended"] == "idle"
        answers = [e.data for e in events.since(engine, session.id, 0, 1000, types=["answer"])]
        assert {a["side"] for a in answers} == {"fine_tuned", "base"}, answers
        assert all(a["request_id"] == opened["request_id"] and "error" not in a
                   and a["usage"]["completion_tokens"] > 0 for a in answers), answers

        # the session has ended: the run's next rotation removes checkpoint 2
        assert checkpoints.rotate(engine, run_id, folder, 2) == ["checkpoint-2"]
        assert sorted(p.name for p in folder.glob("checkpoint-*")) == \
            ["checkpoint-4", "checkpoint-5"]
