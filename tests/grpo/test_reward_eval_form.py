"""The GRPO held-out set and reward eval settings through the form, /api and /v1 (web process
only): stored in the run's spec, refused with the field named when they cannot work."""
from __future__ import annotations

from app.store import repo
from app.store.schema import Dataset
from tests.grpo.test_web_grpo import SHARED, _form, env  # noqa: F401 (the fixture)


def _dataset(env, path, name) -> str:
    return repo.add_dataset(env["engine"], Dataset(filename=name, path=str(path),
                                                   owner=env["user"].id)).id


def test_form_and_api_store_the_held_out_settings(env):
    c = env["client"]
    r = c.get("/runs/new/grpo")
    assert 'name="validation_file"' in r.text and 'name="reward_eval_samples"' in r.text
    r = c.post("/runs/grpo", data=_form(env["dataset"], validation_split_percentage="5",
                                        reward_eval_samples="8"), follow_redirects=False)
    assert r.status_code == 303, r.text[:2000]
    run = repo.get_run(env["engine"], r.headers["location"].rsplit("/", 1)[1])
    assert run.spec["validation_split_percentage"] == 5 and run.spec["reward_eval_samples"] == 8
    page = c.get(f"/runs/{run.id}").text
    assert "Held-out set: <strong>5% of the dataset, shuffled with seed 1</strong>" in page
    assert "No checkpoint on disk yet" in page
    val = _dataset(env, SHARED / "grpo" / "gsm8k" / "test.jsonl", "gsm8k_test.jsonl")
    body = {"model": "stories260K", "dataset": env["dataset"], "validation_file": val,
            "rewards": [{"name": "numeric_match"}]}
    r = c.post("/api/runs/grpo", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["validation_file"] == val
    assert r.json()["spec"]["reward_eval_samples"] == 16  # the default
    # /v1: validation_file and the RFT job's own field names pass through
    r = c.post("/v1/fine_tuning/jobs", json={
        "model": "stories260K", "training_file": env["dataset"], "validation_file": val,
        "method": {"type": "reinforcement", "reinforcement": {"grader": {
            "type": "string_check", "name": "chk", "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}", "operation": "like"}}}})
    assert r.status_code == 200, r.text
    assert repo.get_run(env["engine"], r.json()["id"]).spec["validation_file"] == val


def test_held_out_refusals_name_the_field(env):
    c, ds = env["client"], env["dataset"]
    body = {"model": "stories260K", "dataset": ds, "rewards": [{"name": "numeric_match"}]}
    r = c.post("/api/runs/grpo", json={**body, "reward_eval_samples": 20})
    assert r.status_code == 422
    assert r.json()["error"] == {
        "message": "reward_eval_samples needs a held-out set: set validation_file (a held-out "
                   "dataset) or validation_split_percentage", "param": "reward_eval_samples",
        "code": "invalid_value"}
    r = c.post("/api/runs/grpo", json={**body, "reward_eval_samples": 201,
                                       "validation_split_percentage": 5})
    assert r.status_code == 422 and r.json()["error"]["param"] == "reward_eval_samples"
    r = c.post("/api/runs/grpo", json={**body, "validation_file": ds})
    assert r.status_code == 422 and "must not be the training dataset" in r.text
    sft = _dataset(env, SHARED / "sft" / "identity_alpaca.json", "identity.json")
    r = c.post("/api/runs/grpo", json={**body, "answer_column": "answer", "validation_file": sft})
    assert r.status_code == 422 and r.json()["error"]["param"] == "validation_file"
    assert r.json()["error"]["message"].startswith("held-out prompts: ")
    r = c.post("/api/runs/grpo", json={**body, "validation_file": "file-nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "validation_file"
    r = c.post("/runs/grpo", data=_form(ds, reward_eval_samples="20"))
    assert r.status_code == 422 and "needs a held-out set" in r.text
    assert not [run for run in repo.list_runs(env["engine"])]
