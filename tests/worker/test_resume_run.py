"""Resume (issue 16, "Runs a user can manage") end to end on the CPU: a run cancelled after step
10 of 20 through /api and resumed through /api continues exactly as an uninterrupted run of the
same spec (fp32, stories260K, the real ``train`` job in an in-process worker loop): the per-step
learning rate, the per-step loss (within 1e-5) and the final adapter match, with LoRA dropout
on (RNG) and an epoch boundary crossed after the resume (data order).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from app.store import queue, repo
from app.store.schema import JobState
from tests.conftest import SHARED_DATA, STORIES
from tests.worker.conftest import inline_studio

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(),
                                 reason=f"no test data at {SHARED_DATA}")]

IDENTITY = SHARED_DATA / "sft" / "identity_alpaca.json"
#: 24 rows at batch 2: an epoch is 12 steps, so the resumed half starts a second epoch.
SPEC = {"model": "stories260K", "max_steps": 20, "save_steps": 10, "logging_steps": 1,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
        "learning_rate": 5e-3, "warmup_ratio": 0.1, "lr_scheduler_type": "cosine",
        "lora_dropout": 0.1, "r": 8, "lora_alpha": 16, "max_seq_length": 96,
        "chat_template": "chatml", "seed": 11}


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    rows = d / "identity24.json"
    rows.write_text(json.dumps(json.loads(IDENTITY.read_text())[:24]))
    with inline_studio(d / "data", [rows], "w-resume", heartbeat_seconds=0.05) as studio:
        yield {**studio, "dataset": studio["ids"][rows.name]}


def _create(studio) -> str:
    r = studio["client"].post("/api/runs", json={**SPEC, "dataset": studio["dataset"]})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _steps(client, run_id: str) -> dict[int, tuple[float, float]]:
    """step -> (learning rate, loss) of the run's training metric events, oldest first; a
    step that appears twice fails (a resume must not train a step again)."""
    r = client.get(f"/v1/fine_tuning/jobs/{run_id}/events", params={"limit": 10000})
    assert r.status_code == 200, r.text
    out: dict[int, tuple[float, float]] = {}
    for e in reversed(r.json()["data"]):
        d = e["data"] or {}
        if e["type"] == "metrics" and d.get("train_loss") is not None:
            assert d["step"] not in out, f"step {d['step']} reported twice"
            out[d["step"]] = (d["learning_rate"], d["train_loss"])
    return out


def _train_and_cancel_after(studio, run_id: str, step: int) -> None:
    """Train ``run_id`` in the worker loop (a thread) and cancel it through /api once a training
    metric of ``step`` or later has been reported; returns when the job has ended."""
    c = studio["client"]
    t = threading.Thread(target=studio["worker"].serve, kwargs={"once": True})
    t.start()
    try:
        deadline = time.monotonic() + 120
        while not any(s >= step for s in _steps(c, run_id)) and time.monotonic() < deadline:
            time.sleep(0.02)
        r = c.post(f"/api/runs/{run_id}/cancel")
        assert r.status_code == 200, r.text
    finally:
        t.join(120)


def _adapter(run_id: str, engine) -> dict:
    from safetensors.torch import load_file

    return load_file(Path(repo.get_run(engine, run_id).output_dir) / "adapter"
                     / "adapter_model.safetensors")


def test_cancelled_run_resumes_exactly(studio) -> None:
    import torch

    c, eng, w = studio["client"], studio["engine"], studio["worker"]
    whole = _create(studio)
    w.serve(once=True)
    assert c.get(f"/api/runs/{whole}").json()["state"] == JobState.SUCCEEDED

    cut = _create(studio)
    _train_and_cancel_after(studio, cut, 10)
    first = c.get(f"/api/runs/{cut}").json()
    assert first["state"] == JobState.CANCELLED, first
    done = max(_steps(c, cut))
    assert 10 <= done < 20, f"the cancel landed at step {done}"
    # the cancel saved a checkpoint at the step where training stopped
    ckpt = Path(repo.get_run(eng, cut).output_dir) / "checkpoints" / f"checkpoint-{done}"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "rng_state.pth").is_file()

    r = c.post(f"/api/runs/{cut}/resume")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == JobState.QUEUED and r.json()["id"] == cut
    r = c.post(f"/api/runs/{cut}/resume")
    assert r.status_code == 409 and "still active" in r.json()["error"]["message"]
    w.serve(once=True)
    run = repo.get_run(eng, cut)
    job = queue.get_job(eng, run.job_id)
    assert job.state == JobState.SUCCEEDED, job.error
    assert job.result["steps"] == 20
    # each attempt's training is recorded; the run's training time is their sum
    from app.studio.train_time import segments
    segs = segments(eng, job)
    assert [(g["from_step"], g["to_step"]) for g in segs] == [(0, done), (done, 20)]
    assert segs[1]["job_id"] == job.id != segs[0]["job_id"]
    assert segs[1]["train_runtime"] == job.result["train_runtime"]
    tt = c.get(f"/api/runs/{cut}").json()["training_time"]
    assert tt == {"this_attempt": job.result["train_runtime"], "attempts": 2, "resumed": True,
                  "running": False, "all_attempts": round(sum(g["train_runtime"] for g in segs), 3)}
    assert tt["all_attempts"] > tt["this_attempt"] > 0

    want, got = _steps(c, whole), _steps(c, cut)
    assert sorted(want) == sorted(got) == list(range(1, 21))
    for step in want:
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-9, abs=0), step
        assert abs(got[step][1] - want[step][1]) <= 1e-5, (step, got[step], want[step])
    a, b = _adapter(whole, eng), _adapter(cut, eng)
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    # the resumed job names where it started; the first attempt's loss is the run's first loss
    logs = [e["message"] for e in c.get(f"/v1/fine_tuning/jobs/{cut}/events",
                                        params={"limit": 10000}).json()["data"]]
    assert f"resuming from checkpoint-{done}" in logs
    # ...and says the step as data: the run's training time starts the attempt there
    from app.store import events
    resumed = [e.data for e in events.since(eng, job.id, 0, 10000, types=["log"])
               if e.data.get("message") == f"resuming from checkpoint-{done}"]
    assert [d.get("resume_step") for d in resumed] == [done], resumed
    whole_job = queue.get_job(eng, repo.get_run(eng, whole).job_id)
    assert job.result["first_loss"] == whole_job.result["first_loss"] == want[1][1]
    assert job.result["train_loss"] == pytest.approx(whole_job.result["train_loss"], abs=1e-5)
    assert job.result["final_loss"] == whole_job.result["final_loss"]
    r = c.post(f"/api/runs/{cut}/resume")
    assert r.status_code == 409 and "already succeeded" in r.json()["error"]["message"]


def test_resumed_runs_eval_summary_covers_every_attempt(studio) -> None:
    """A run with a held-out set, cancelled after its step-4 evaluation and resumed: the result's
    ``eval`` counts the evaluations of both attempts and its first loss is step 0's (the base
    model's), as the run's own events show (trial s21 F4: it counted the last attempt only)."""
    c, eng, w = studio["client"], studio["engine"], studio["worker"]
    spec = {**SPEC, "max_steps": 12, "save_steps": 4, "eval_steps": 4, "validation_split_percentage": 25}
    r = c.post("/api/runs", json={**spec, "dataset": studio["dataset"]})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]

    def evals() -> dict[int, float]:
        r = c.get(f"/v1/fine_tuning/jobs/{run_id}/events", params={"limit": 10000})
        return {e["data"]["step"]: e["data"]["eval_loss"] for e in r.json()["data"]
                if e["type"] == "metrics" and "eval_loss" in (e["data"] or {})}

    _train_and_cancel_after(studio, run_id, 5)
    assert c.get(f"/api/runs/{run_id}").json()["state"] == JobState.CANCELLED
    first_attempt = evals()
    assert 0 in first_attempt and 4 in first_attempt
    assert c.post(f"/api/runs/{run_id}/resume").status_code == 200
    w.serve(once=True)
    job = queue.get_job(eng, repo.get_run(eng, run_id).job_id)
    assert job.state == JobState.SUCCEEDED, job.error
    every = evals()
    assert sorted(every) == [0, 4, 8, 12]
    summary = job.result["eval"]
    assert summary["evaluations"] == 4
    assert summary["first_eval_loss"] == every[0] == first_attempt[0]
    assert summary["last_eval_loss"] == every[12]
