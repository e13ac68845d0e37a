"""Held-out evaluation end to end on the CPU: real uploads over HTTP, runs created through /v1
(``validation_file`` + ``eval_steps`` as an extra body field) and /api (a percentage split with
early stopping), the real ``train`` job on stories260K (in-process worker loop), then what /v1,
/api and the run page show: eval loss every ``eval_steps``, the best checkpoint (its weights are
the adapter with ``load_best_model_at_end``), early stopping, and the generation eval table.
"""
from __future__ import annotations

import html
import json
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
SMALL = {"max_seq_length": 256, "learning_rate": 1e-2, "r": 8, "lora_alpha": 16,
         "warmup_ratio": 0.0, "gradient_accumulation_steps": 1, "chat_template": "chatml"}


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    rows = json.loads(IDENTITY.read_text())
    train, val = d / "identity_train.json", d / "identity_val.json"
    train.write_text(json.dumps(rows[:70]))
    val.write_text(json.dumps(rows[70:]))
    with inline_studio(d / "data", [train, val, IDENTITY], "w-eval",
                       heartbeat_seconds=0.5) as studio:
        yield {**studio, "val_rows": rows[70:]}


def _train(studio, run_id: str):
    studio["worker"].serve(once=True)
    run = repo.get_run(studio["engine"], run_id)
    job = queue.get_job(studio["engine"], run.job_id)
    assert job.state == JobState.SUCCEEDED, job.error
    return run, job


def _events(client, run_id: str) -> list[dict]:
    r = client.get(f"/v1/fine_tuning/jobs/{run_id}/events", params={"limit": 10000})
    assert r.status_code == 200, r.text
    return list(reversed(r.json()["data"]))  # oldest first


def test_validation_file_through_v1(studio) -> None:
    from safetensors.torch import load_file

    from worker.engine.evaluation import token_f1

    c, ids = studio["client"], studio["ids"]
    body = {"model": "stories260K", "training_file": ids["identity_train.json"],
            "validation_file": ids["identity_val.json"], "hyperparameters": {"batch_size": 4},
            "max_steps": 12, "save_steps": 4, "eval_steps": 4, "load_best_model_at_end": True,
            "generation_eval_samples": 3, **SMALL}
    r = c.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    job_obj = r.json()
    assert job_obj["validation_file"] == ids["identity_val.json"]
    assert job_obj["whetstone"]["spec"]["eval_steps"] == 4
    run, job = _train(studio, job_obj["id"])

    # /v1 list_events: eval loss at step 0 (the base model) and every eval_steps
    evs = _events(c, run.id)
    evals = [e for e in evs if e["type"] == "metrics" and "eval_loss" in (e["data"] or {})]
    assert [e["data"]["step"] for e in evals] == [0, 4, 8, 12]
    for e in evals:
        assert e["data"]["valid_loss"] == e["data"]["eval_loss"] > 0
        assert e["message"] == (f"Step {e['data']['step']}/12: eval loss="
                                f"{e['data']['eval_loss']:.4f}")
    losses = {e["data"]["step"]: e["data"]["eval_loss"] for e in evals}
    assert losses[12] < 0.7 * losses[0], losses  # training on the same kind of rows helps
    best_step = min((s for s in losses if s > 0), key=lambda s: (losses[s], s))
    best_ev = [e for e in evs if e["type"] == "metrics" and "best_step" in (e["data"] or {})]
    assert len(best_ev) == 1 and best_ev[0]["data"]["best_step"] == best_step
    assert best_ev[0]["message"].startswith(f"Best checkpoint: checkpoint-{best_step} ")

    # the result and the files: the adapter is the best checkpoint's weights
    ev = job.result["eval"]
    assert ev["source"] == "validation_file" and ev["rows"] == 21 and ev["training_rows"] == 70
    assert ev["row_numbers"] == list(range(1, 22))
    assert ev["best_step"] == best_step and ev["best_eval_loss"] == losses[best_step]
    assert ev["evaluations"] == 4 and ev["early_stopped"] is False
    run_dir = Path(run.output_dir)
    best = load_file(run_dir / "checkpoints" / f"checkpoint-{best_step}" / "adapter_model.safetensors")
    final = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert best.keys() == final.keys() and all((best[k] == final[k]).all() for k in best)
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["held_out"]["validation_file"] == ids["identity_val.json"]
    assert cfg["training_arguments"]["eval_steps"] == 4
    assert cfg["training_arguments"]["metric_for_best_model"] == "eval_loss"

    # /v1 checkpoints carry the held-out loss of their step
    r = c.get(f"/v1/fine_tuning/jobs/{run.id}/checkpoints")
    for ck in r.json()["data"]:
        assert ck["metrics"]["valid_loss"] == losses[ck["step_number"]]

    # generation eval: base vs fine-tuned greedy answers beside the reference
    gen = job.result["generation_eval"]
    assert gen["summary"]["samples"] == 3 and len(gen["rows"]) == 3
    for row, want in zip(gen["rows"], studio["val_rows"]):
        assert row["reference"] == want["output"]  # the held-out row's own answer
        assert want["instruction"] in row["prompt"]
        assert row["fine_tuned_token_f1"] == token_f1(row["fine_tuned"], row["reference"])
        assert row["base_token_f1"] == token_f1(row["base"], row["reference"])
        assert row["base"] != row["fine_tuned"]
    arts = {a["kind"]: a for a in c.get(f"/api/runs/{run.id}").json()["artifacts"]}
    stored = json.loads(c.get(arts["eval"]["download_url"]).content)
    assert stored["generation_eval"] == gen

    # the run page: held-out set, best checkpoint, the table
    page = c.get(f"/runs/{run.id}").text
    assert "validation_file identity_val.json" in page and "21 rows held out" in page
    assert f"Best checkpoint: <strong>checkpoint-{best_step}</strong>" in page
    assert "the adapter is this checkpoint" in page
    assert 'id="generation-eval"' in page
    assert html.escape(gen["rows"][0]["reference"]) in page


def test_percentage_split_and_early_stopping_through_api(studio) -> None:
    from worker.engine.evaluation import split_held_out

    c = studio["client"]
    spec = {"model": "stories260K", "dataset": studio["ids"]["identity_alpaca.json"],
            "per_device_train_batch_size": 4, "max_steps": 40, "save_steps": 2, "eval_steps": 2,
            "validation_split_percentage": 10, "early_stopping_patience": 1,
            # no evaluation improves by 1e6, so the first one after the best stops training
            "early_stopping_threshold": 1e6, "load_best_model_at_end": True, **SMALL}
    r = c.post("/api/runs", json=spec)
    assert r.status_code == 201, r.text
    run, job = _train(studio, r.json()["id"])
    assert job.result["steps"] == 4  # evaluations at 0, 2 (best so far), 4 (not better: stop)
    ev = job.result["eval"]
    assert ev["early_stopped"] is True and ev["best_step"] in (2, 4)
    assert ev["source"] == "validation_split_percentage" and ev["seed"] == 3407
    assert ev["rows"] == 9 and ev["training_rows"] == 82  # 10% of identity_alpaca's 91 rows
    held = split_held_out(91, 10, 3407)[1]
    assert ev["row_numbers"] == [i + 1 for i in held]  # the file's 1-based row numbers
    assert split_held_out(91, 10, 1)[1] != held  # the seed picks the rows
    assert "generation_eval" not in job.result
    evs = _events(c, run.id)
    assert [e["data"]["step"] for e in evs
            if e["type"] == "metrics" and "eval_loss" in e["data"]] == [0, 2, 4]
    assert any("stopped early at step 4" in e["message"] for e in evs)
    m = c.get(f"/api/runs/{run.id}").json()["metrics"]
    assert m["count"] == 4  # four training steps; the evaluations carry no training loss
    page = c.get(f"/runs/{run.id}").text
    assert "10% of the dataset, shuffled with seed 3407" in page
    assert "9 rows held out, 82 trained on" in page and "Stopped early" in page
