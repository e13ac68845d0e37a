"""max_seq_length: one default (the model's context, capped at 1024) and one bound (the context
above, what the chat template needs below) for the form, /api and /v1 alike (issue 19 item 6,
issue 20's "max_seq_length 64 is accepted and then every run fails")."""
from __future__ import annotations

import html

import pytest

from app.store import repo
from app.store.schema import Dataset, Model
from tests.conftest import SHARED_DATA


@pytest.fixture
def ready(client, engine, stories_hf):
    """A ready stories260K-like model (the real converted llama2.c model, 512-token context) and
    a processed dataset, both shared with / owned by the signed-in admin."""
    model = repo.add_model(engine, Model(name="tiny-ready", source="local", source_ref="x",
                                         path=str(stories_hf), status="ready", shared=True,
                                         info={"max_position_embeddings": 512}),
                           import_job=False)
    ds = repo.add_dataset(engine, Dataset(filename="alpaca.json", format="alpaca", rows=10,
                                          path=str(SHARED_DATA / "sft" / "alpaca_en_demo.json")))
    return model, ds


def test_api_and_v1_default_to_the_model_context(client, ready):
    model, ds = ready
    r = client.post("/api/runs", json={"model": model.name, "dataset": ds.id})
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["max_seq_length"] == 512  # not TrainSpec's 1024
    r = client.post("/v1/fine_tuning/jobs", json={"model": model.name, "training_file": ds.id})
    assert r.status_code == 200, r.text
    assert r.json()["whetstone"]["spec"]["max_seq_length"] == 512


@pytest.mark.parametrize("surface", ["api", "v1", "form"])
def test_past_the_context_or_below_the_template_is_a_field_error(client, ready, surface):
    model, ds = ready
    for length, words in ((4096, "longer than tiny-ready's context window (512 tokens"),
                          (64, "cannot hold even a one-line question and answer in the chatml")):
        if surface == "api":
            r = client.post("/api/runs", json={"model": model.name, "dataset": ds.id,
                                               "max_seq_length": length, "chat_template": "chatml"})
            assert r.status_code == 422 and r.json()["error"]["param"] == "max_seq_length"
            assert words in r.json()["error"]["message"]
        elif surface == "v1":
            r = client.post("/v1/fine_tuning/jobs", json={"model": model.name,
                            "training_file": ds.id, "max_seq_length": length})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_seq_length"
            assert words in r.json()["error"]["message"]
        else:
            r = client.post("/runs", data={"model": model.id, "dataset": ds.id,
                                           "max_seq_length": str(length),
                                           "chat_template_choice": "chatml",
                                           "target_modules": ["q_proj", "v_proj"]})
            assert r.status_code == 422 and words in html.unescape(r.text)
    assert repo.list_runs(client.app.state.engine) == []
    # the smallest length that holds the exchange is accepted
    r = client.post("/api/runs", json={"model": model.name, "dataset": ds.id,
                                       "max_seq_length": 128, "chat_template": "chatml"})
    assert r.status_code == 201, r.text
