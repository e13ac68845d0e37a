"""Numbers no float or int() can hold, and malformed /v1 reinforcement hyperparameters, are a
4xx naming the field on every surface, never a 500 (trial-break F1-F3, F7: JSON allows an
integer of 400 digits, ``str.isdigit()`` takes "²", a batch of 0 divided the n_epochs steps)."""
from __future__ import annotations

import html
import json

from app.store import repo
from tests.web.test_openai_lr_multiplier import GRADER, file_id  # noqa: F401 (fixture)

HUGE = 10**400
MSGS = [{"role": "user", "content": "Hi"}]


def test_huge_sampling_numbers_are_refused_naming_the_field(client, engine):
    repo.update_model(engine, "model-stories260K", status="ready")
    for field in ("temperature", "top_p", "max_tokens", "top_k", "min_p", "repetition_penalty"):
        for path, status in (("/v1/chat/completions", 400), ("/api/playground/sessions", 422)):
            r = client.post(path, json={"model": "stories260K", "messages": MSGS, field: HUGE})
            assert r.status_code == status, (path, field, r.status_code)
            err = r.json()["error"]
            assert err["param"] == field and "not a number of 401 digits" in err["message"], err


#: (hyperparameters under method.reinforcement, or top-level ones, param of the 400)
BAD_RL = (({"method": [1]}, "method.reinforcement.hyperparameters"),
          ({"method": "x"}, "method.reinforcement.hyperparameters"),
          ({"top": [1]}, "hyperparameters"),
          ({"method": {"batch_size": 0, "n_epochs": 1}}, "hyperparameters.batch_size"),
          ({"method": {"gradient_accumulation_steps": 0, "n_epochs": 1}},
           "gradient_accumulation_steps"),
          ({"method": {"batch_size": "abc", "n_epochs": 1}}, "hyperparameters.batch_size"),
          ({"method": {"batch_size": [1], "n_epochs": 1}}, "hyperparameters.batch_size"),
          ({"method": {"n_epochs": HUGE}}, "hyperparameters.n_epochs"))


def test_v1_jobs_and_checkpoint_steps_refuse_what_no_number_holds(client, file_id):
    # learning_rate_multiplier of 401 digits
    r = client.post("/v1/fine_tuning/jobs", json={
        "model": "stories260K", "training_file": file_id,
        "hyperparameters": {"learning_rate_multiplier": HUGE}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "hyperparameters.learning_rate_multiplier"
    assert err["message"].endswith("not a number of 401 digits"), err
    # reinforcement hyperparameters that are no object, a zero batch, no number
    for hp, param in BAD_RL:
        rl = {"grader": GRADER, **({"hyperparameters": hp["method"]} if "method" in hp else {})}
        body = {"model": "stories260K", "training_file": file_id,
                "method": {"type": "reinforcement", "reinforcement": rl},
                **({"hyperparameters": hp["top"]} if "top" in hp else {})}
        r = client.post("/v1/fine_tuning/jobs", json=body)
        assert r.status_code == 400, (hp, r.text)
        assert r.json()["error"]["param"] == param, (hp, r.json())
    # a checkpoint step of other digits than 0-9, or more than int() reads
    r = client.post("/v1/fine_tuning/jobs", json={"model": "stories260K",
                                                  "training_file": file_id})
    run_id = r.json()["id"]
    for bad, shown in (("%C2%B2", "'²'"), ("%D9%A5", "'٥'"), ("1" * 5000, "'" + "1" * 40 + "…'"),
                       ("9" * 19, "'" + "9" * 19 + "'")):
        for url in (f"/api/runs/{run_id}/checkpoints/{bad}/download",
                    f"/runs/{run_id}/checkpoints/{bad}/download"):
            r = client.get(url)
            assert r.status_code == 422, (url[:80], r.status_code)
            assert f"step {shown} is not a checkpoint step" in html.unescape(r.text), url[:80]


def _post(client, path: str, body: dict):
    """POST ``body`` as JSON that may hold Infinity (Python's json reads it; httpx won't send it)."""
    return client.post(path, content=json.dumps(body),
                       headers={"content-type": "application/json"})


def test_checkpoint_ids_export_steps_and_eval_counts_that_are_no_whole_number(client, engine,
                                                                                file_id):
    repo.update_model(engine, "model-stories260K", status="ready")
    run_id = client.post("/v1/fine_tuning/jobs", json={"model": "stories260K",
                                                       "training_file": file_id}).json()["id"]
    assert client.post(f"/api/runs/{run_id}/cancel").status_code == 200
    # a checkpoint model id of other digits or 5000 of them: an unknown model
    for step in ("²", "1" * 5000):
        model = f"stories260K:ft:{run_id}:checkpoint-{step}"
        for path, key in (("/v1/chat/completions", "messages"), ("/api/playground/sessions", "x")):
            r = client.post(path, json={"model": model, key: MSGS})
            assert r.status_code == 404, (path, step[:5], r.status_code)
            assert r.json()["error"]["code"] == "model_not_found"
    # the run form pre-filled with a max_seq_length of other digits keeps the default
    r = client.get("/runs/new?max_seq_length=%C2%B2")
    assert r.status_code == 200 and 'name="max_seq_length"' in r.text
    # an export's checkpoint_step of 12.5 was cut to 12, inf was a 500
    for bad in (12.5, float("inf"), True, "²"):
        r = _post(client, f"/api/runs/{run_id}/exports", {"format": "adapter",
                                                          "checkpoint_step": bad})
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"] == {"message": "must be a whole number (a checkpoint's step)",
                                     "param": "checkpoint_step", "code": "invalid_value"}
    # a checkpoint eval of inf samples was a 500
    for bad in (float("inf"), 2.5, True):
        r = _post(client, f"/api/runs/{run_id}/checkpoints/2/evaluations", {"samples": bad})
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["param"] == "samples", r.json()
