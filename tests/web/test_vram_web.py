"""The GPU memory estimate over HTTP: the run forms' htmx fragment, the too-big refusal (form,
/api), and the run page and /api/runs/{id} showing the estimate beside the measured peak."""
from __future__ import annotations

import re

from app.store import queue, repo
from app.store import workers as workers_store
from app.store.schema import Model
from app.studio import calibration
from tests.studio.test_vram_estimate import LLAMA_8B_INFO, spec_for
from tests.web.test_web_runs import _upload

FORM = {"r": "16", "lora_alpha": "16", "max_seq_length": "2048", "per_device_train_batch_size": "2",
        "gradient_accumulation_steps": "1", "load_in_4bit": "true", "max_steps": "10",
        "chat_template_choice": "chatml", "learning_rate": "2e-4",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]}


def _llama(engine) -> Model:
    return repo.add_model(engine, Model(name="llama-3.1-8b", source="hf", source_ref="x",
                                        status="ready", shared=True, info=dict(LLAMA_8B_INFO)),
                          import_job=False)


def _total(html: str) -> float:
    return float(re.search(r'id="estimate-total">([\d.]+) GiB', html).group(1))


def test_form_fragment_follows_the_fields(client, engine):
    model = _llama(engine)
    page = client.get(f"/runs/new?model={model.id}")
    assert 'hx-post="/runs/new/estimate"' in page.text and 'hx-trigger="change from:closest form' \
        in page.text
    r = client.post("/runs/new/estimate", data={**FORM, "model": model.id},
                    headers={"HX-Request": "true"})
    assert r.status_code == 200 and "<html" not in r.text
    want = calibration.estimate(engine, model, spec_for("train_step", "qlora", 2048, 2, None),
                                "train")
    assert _total(r.text) == round(want.total_gib, 1) == 7.2  # 6.74 allocator + 0.5 context
    assert "weights</th><td>5.31 GiB" in r.text and "not yet calibrated" in r.text
    longer = client.post("/runs/new/estimate",
                         data={**FORM, "model": model.id, "max_seq_length": "16384",
                               "per_device_train_batch_size": "1"}).text
    assert _total(longer) == 9.1
    bf16 = client.post("/runs/new/estimate", data={**FORM, "model": model.id,
                                                   "load_in_4bit": ""}).text
    assert _total(bf16) == 16.9 and "weights</th><td>14.96 GiB" in bf16
    bad = client.post("/runs/new/estimate", data={**FORM, "model": model.id, "r": "0"}).text
    assert "estimate-total" not in bad and "r: must be from 1 to 1,024, not &#39;0&#39;" in bad
    grpo = client.post("/runs/new/grpo/estimate",
                       data={**FORM, "model": model.id, "num_generations": "8",
                             "per_device_train_batch_size": "8", "max_prompt_length": "1024",
                             "max_completion_length": "1024"}).text
    assert _total(grpo) == 9.3 and "KV cache</th><td>2.01 GiB" in grpo
    pending = client.post("/runs/new/estimate",
                          data={**FORM, "model": "stories260K"}).text  # not imported here
    assert "not imported yet" in pending


def test_too_big_run_refused_with_estimate_and_largest_gpu(client, engine):
    model = _llama(engine)
    ds = _upload(client)
    big = {**FORM, "model": model.id, "dataset": ds, "load_in_4bit": "",
           "max_seq_length": "131072", "per_device_train_batch_size": "4"}
    ok = client.post("/api/runs", json={"model": model.id, "dataset": ds, "max_seq_length": 131072,
                                        "per_device_train_batch_size": 4})
    assert ok.status_code == 201  # no GPU worker reports its size: no refusal
    workers_store.register(engine, "w-cpu", "box", 1, "cpu (2 cores)")
    workers_store.register(engine, "w-gpu", "box", 2, "cuda:0 NVIDIA H100", 79.2)
    frag = client.post("/runs/new/estimate", data=big).text
    assert "Too big for the largest live GPU (79.2 GiB)" in frag and _total(frag) > 79.2
    r = client.post("/runs", data=big, headers={"HX-Request": "true"})
    assert r.status_code == 422
    assert f"this run needs about {_total(frag):.1f} GiB of GPU memory" in r.text
    assert "the largest GPU of the live workers has 79.2 GiB" in r.text
    r = client.post("/api/runs", json={"model": model.id, "dataset": ds, "max_seq_length": 131072,
                                       "per_device_train_batch_size": 4})
    assert r.status_code == 422 and "79.2 GiB" in r.text
    assert len(client.get("/api/runs").json()["data"]) == 1
    fits = client.post("/runs/new/estimate", data={**big, "load_in_4bit": "true",
                                                    "max_seq_length": "2048"}).text
    assert "Fits the largest live GPU (79.2 GiB)" in fits


def test_run_page_and_api_show_estimate_beside_measured_peak(client, engine):
    model = _llama(engine)
    ds = _upload(client)
    r = client.post("/api/runs", json={"model": model.id, "dataset": ds, "load_in_4bit": True,
                                       "max_seq_length": 2048, "per_device_train_batch_size": 2})
    run_id = r.json()["id"]
    mem = r.json()["memory"]
    assert mem["estimate_gib"] == round(calibration.estimate(
        engine, model, spec_for("train_step", "qlora", 2048, 2, None), "train").allocated_gib, 4)
    assert mem["peak_gib"] is None and mem["error"] is None
    job = queue.claim(engine, "w-gpu", 60, ["train"])
    assert job.run_id == run_id
    queue.finish(engine, job.id, "w-gpu", {"memory_peak": {
        "kind": "gpu", "peak_gib": 6.76, "reserved_gib": 8.68, "nvml_gib": 9.3}})
    api = client.get(f"/api/runs/{run_id}").json()["memory"]
    assert api["peak_gib"] == 6.76 and api["peak_kind"] == "gpu" and api["reserved_gib"] == 8.68
    assert api["error"] == round((mem["estimate_gib"] - 6.76) / 6.76, 4)
    page = client.get(f"/runs/{run_id}").text
    assert (f'id="mem-estimate">{mem["estimate_gib"] + 0.5:.1f} GiB on the GPU<span '
            f'class="small muted mem-parts"> ({mem["estimate_gib"]:.2f} GiB for training') in page
    assert 'id="mem-peak">6.76 GiB GPU' in page
    assert f'id="mem-error">{api["error"] * 100:+.1f}%' in page and "NVML 9.30 GiB" in page
    # the next run of this model and shape is corrected by the measured peak
    frag = client.post("/runs/new/estimate", data={**FORM, "model": model.id}).text
    assert "from 1 earlier run of this model" in frag
