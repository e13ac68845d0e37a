"""Held-out evaluation settings over HTTP (no worker): what /api, /v1 and the run form accept,
store and refuse (app.studio.evaluation.check_held_out), field by field."""
from __future__ import annotations

import pytest

from tests.conftest import SHARED_DATA, need_shared_data
from tests.web.conftest import run_validations

ALPACA = SHARED_DATA / "sft" / "alpaca_en_demo.json"
IDENTITY = SHARED_DATA / "sft" / "identity_alpaca.json"


def _upload(client, path, headers=None) -> str:
    with path.open("rb") as fh:
        r = client.post("/v1/files", files={"file": (path.name, fh)},
                        data={"purpose": "fine-tune"}, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()["id"]


@pytest.fixture
def files(app, client):
    need_shared_data()
    ids = {"train": _upload(client, ALPACA), "val": _upload(client, IDENTITY)}
    run_validations(app)
    return ids


def _create(client, files, **spec):
    return client.post("/api/runs", json={"model": "stories260K", "dataset": files["train"],
                                          "max_steps": 4, **spec})


def test_held_out_settings_are_stored(client, files) -> None:
    r = _create(client, files, validation_file=files["val"], eval_steps=10, save_steps=20,
                load_best_model_at_end=True, early_stopping_patience=3,
                generation_eval_samples=5)
    assert r.status_code == 201, r.text
    spec = r.json()["spec"]
    assert (spec["validation_file"], spec["eval_steps"], spec["save_steps"]) == (files["val"], 10, 20)
    assert spec["load_best_model_at_end"] is True and spec["early_stopping_patience"] == 3
    assert spec["generation_eval_samples"] == 5
    page = client.get(f"/runs/{r.json()['id']}").text
    assert "Held-out set: <strong>validation_file identity_alpaca.json</strong>" in page
    assert "Eval loss every 10 steps" in page
    r = _create(client, files, validation_split_percentage=12.5)
    assert r.status_code == 201, r.text
    page = client.get(f"/runs/{r.json()['id']}").text
    assert "12.5% of the dataset, shuffled with seed 3407" in page
    # a run without a held-out set has no Evaluation card
    r = _create(client, files)
    assert r.status_code == 201 and 'id="eval-card"' not in client.get(f"/runs/{r.json()['id']}").text


@pytest.mark.parametrize("spec, field, text", [
    ({"eval_steps": 5}, "eval_steps", "eval_steps needs a held-out set"),
    ({"load_best_model_at_end": True}, "load_best_model_at_end", "needs a held-out set"),
    ({"early_stopping_patience": 2}, "early_stopping_patience", "needs a held-out set"),
    ({"generation_eval_samples": 4}, "generation_eval_samples", "needs a held-out set"),
    ({"validation_file": "VAL", "validation_split_percentage": 10}, "validation_split_percentage",
     "not both"),
    ({"validation_file": "TRAIN"}, "validation_file", "must not be the training dataset"),
    ({"validation_split_percentage": 10, "load_best_model_at_end": True, "eval_steps": 7,
      "save_steps": 50}, "save_steps", "save_steps (50) must be a multiple of eval_steps (7)"),
    ({"validation_split_percentage": 60}, "validation_split_percentage",
     "must be from 0 to 50, not 60"),
])
def test_refused(client, files, spec, field, text) -> None:
    spec = {k: {"VAL": files["val"], "TRAIN": files["train"]}.get(v, v) if isinstance(v, str) else v
            for k, v in spec.items()}
    r = _create(client, files, **spec)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == field and text in err["message"], err


def test_unknown_or_another_users_validation_file_is_404(app, client, files) -> None:
    r = _create(client, files, validation_file="file-nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "validation_file"
    r = client.post("/api/users", json={"name": "bob", "password": "bob-password-1",
                                        "role": "member"})
    assert r.status_code == 201, r.text
    tok = client.post("/api/login/access-token",
                      data={"username": "bob", "password": "bob-password-1"}).json()["access_token"]
    bob = {"Authorization": f"Bearer {tok}"}
    mine = _upload(client, IDENTITY, bob)  # bob's own copy is fine for bob...
    run_validations(app)
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": mine, "max_steps": 4,
                                       "validation_file": files["val"]}, headers=bob)
    assert r.status_code == 404, r.text  # ...the admin's file is not bob's to use
    assert r.json()["error"]["param"] == "validation_file"


def test_v1_validation_file_and_eval_steps(client, files) -> None:
    body = {"model": "stories260K", "training_file": files["train"],
            "validation_file": files["val"], "eval_steps": 3, "save_steps": 6, "max_steps": 6}
    r = client.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["validation_file"] == files["val"] and job["whetstone"]["spec"]["eval_steps"] == 3
    assert client.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["validation_file"] == files["val"]
    r = client.post("/v1/fine_tuning/jobs", json={**body, "validation_file": files["train"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "validation_file"
    r = client.post("/v1/fine_tuning/jobs", json={**body, "validation_file": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "validation_file"
    r = client.post("/v1/fine_tuning/jobs", json={k: v for k, v in body.items()
                                                  if k != "validation_file"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "eval_steps"


def test_run_form_evaluation_fields(client, files) -> None:
    page = client.get("/runs/new").text
    assert 'name="validation_file"' in page and 'name="load_best_model_at_end"' in page
    assert 'name="eval_steps" min="1" value=""' in page  # empty, not "None"
    form = {"model": "stories260K", "dataset": files["train"], "max_steps": "4",
            "validation_split_percentage": "10", "eval_steps": "2", "save_steps": "4",
            "load_best_model_at_end": "true", "early_stopping_patience": "",
            "target_modules": ["q_proj", "v_proj"], "chat_template_choice": "chatml"}
    r = client.post("/runs", data=form, follow_redirects=False)
    assert r.status_code == 303, r.text
    run = client.get(r.headers["location"].replace("/runs/", "/api/runs/")).json()
    assert run["spec"]["validation_split_percentage"] == 10
    assert run["spec"]["eval_steps"] == 2 and run["spec"]["load_best_model_at_end"] is True
    assert run["spec"]["early_stopping_patience"] is None
    r = client.post("/runs", data={**form, "save_steps": "5"})
    assert r.status_code == 422 and "must be a multiple of eval_steps (2)" in r.text
