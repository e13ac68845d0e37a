"""``num_gpus`` (issue 18) over HTTP: the run form offers it and says what the box has, and the
run form and /api refuse more GPUs than a live host has, or accumulation steps that do not split
over them, naming the field."""
from __future__ import annotations

from app.store import repo
from app.store import workers as workers_store
from tests.web.test_vram_web import FORM, _llama
from tests.web.test_web_runs import _upload


def test_num_gpus_is_offered_and_checked_against_the_live_host(client, engine):
    model = _llama(engine)
    ds = _upload(client)
    body = {"model": model.id, "dataset": ds, "load_in_4bit": True, "max_seq_length": 2048,
            "gradient_accumulation_steps": 4}
    r = client.post("/api/runs", json={**body, "num_gpus": 2})
    assert r.status_code == 422 and "num_gpus" in r.text and "no live worker has a GPU" in r.text
    for i in range(2):
        workers_store.register(engine, f"sup-gpu{i}", "box", 1, f"cuda:{i} NVIDIA H200",
                               139.8, i, 137.8)
    page = client.get(f"/runs/new?model={model.id}").text
    assert 'name="num_gpus" value="1"' in page
    assert 'name="num_gpus" value="1"' in client.get(f"/runs/new/grpo?model={model.id}").text
    frag = client.post("/runs/new/estimate", data={**FORM, "model": model.id}).text
    assert "this box has 2 GPUs on one host" in frag
    r = client.post("/api/runs", json={**body, "num_gpus": 3})
    assert r.status_code == 422 and "num_gpus 3 is more than this box has" in r.text
    assert "the live host with the most GPUs has 2" in r.text
    r = client.post("/api/runs", json={**body, "num_gpus": 2, "gradient_accumulation_steps": 3})
    assert r.status_code == 422 and "gradient_accumulation_steps (3) must be a multiple of " \
        "num_gpus (2)" in r.text
    form = client.post("/runs", data={**FORM, "model": model.id, "dataset": ds, "num_gpus": "3"},
                       headers={"HX-Request": "true"})
    assert form.status_code == 422 and "num_gpus 3 is more than this box has" in form.text
    r = client.post("/api/runs", json={**body, "num_gpus": 2})
    assert r.status_code == 201, r.text
    assert repo.get_run(engine, r.json()["id"]).spec["num_gpus"] == 2
