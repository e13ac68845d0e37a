"""Numbers no float or int() can hold, and malformed /v1 reinforcement hyperparameters, are a
4xx naming the field on every surface, never a 500 (trial-break F1-F3, F7: JSON allows an
integer of 400 digits, ``str.isdigit()`` takes "²", a batch of 0 divided the n_epochs steps)."""
from __future__ import annotations

import html

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
