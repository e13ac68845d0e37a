"""One rule for the models a user can use (app.studio.models.usable_models): a model whose import
failed is in no model list (/v1/models, the SFT and GRPO forms, the dataset page) but stays on
the Models page with its reason; a fine-tuned model id as a job's ``model`` gets a clear 400
naming ``model``, not a misleading 404. Over HTTP against the real app on a real SQLite file."""
from __future__ import annotations

import re

from app.store import repo
from app.store.schema import Model
from tests.web.conftest import upload_sft


def _failed(engine) -> Model:
    return repo.add_model(engine, Model(name="qwen-test", source="hf", source_ref="Qwen/nope",
                                        status="failed", error="404 Client Error: repo not found"),
                          import_job=False)


def _options(html: str) -> list[str]:
    select = re.search(r'<select[^>]*name="model"[^>]*>(.*?)</select>', html, re.S).group(1)
    return [re.sub(r"\s+", " ", o).strip() for o in re.findall(r"<option[^>]*>(.*?)</option>",
                                                                 select, re.S)]


def test_a_failed_model_is_in_no_model_list(client, engine):
    bad = _failed(engine)
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["stories260K"]
    r = client.get("/v1/models/qwen-test")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/models/stories260K").json()["id"] == "stories260K"
    dataset = upload_sft(client)
    for page in ("/runs/new", "/runs/new/grpo", f"/datasets/{dataset}"):
        r = client.get(page)
        assert r.status_code == 200, page
        assert _options(r.text) == ["stories260K (pending)"], page  # pending: usable, waits
        assert "qwen-test" not in r.text, page
    models_page = client.get("/models").text  # where its reason is shown, with Retry/Delete
    assert "qwen-test" in models_page and f"/models/{bad.id}/retry" in models_page
    assert "qwen-test" in [m["name"] for m in client.get("/api/models").json()["data"]]


def test_fine_tuning_a_fine_tuned_model_is_a_clear_400_naming_model(client, engine):
    dataset = upload_sft(client)
    ft = "stories260K:ft:run-0123456789ab"
    r = client.post("/v1/fine_tuning/jobs", json={"model": ft, "training_file": dataset})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("model", "fine_tuned_model_not_supported")
    assert "fine-tuning a fine-tuned model" in err["message"] and "not supported yet" in \
        err["message"] and "'stories260K'" in err["message"]
    r = client.post("/api/runs", json={"model": ft + ":checkpoint-2", "dataset": dataset})
    assert r.status_code == 422 and "its base model 'stories260K'" in r.text
    r = client.post("/v1/fine_tuning/jobs", json={"model": "nope", "training_file": dataset})
    assert r.status_code == 404  # an unknown base model still is one
