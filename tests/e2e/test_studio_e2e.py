"""End to end: the real web process and worker, driven by the official ``openai`` client.

Uploads real data from ../shared/data, fine-tunes the real stories260K for 30 steps on the
CPU, reads the run's SSE stream to the end, then checks that the loss fell and that the
downloaded adapter loads in PEFT and changes the model's greedy output.
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import httpx
import openai
import pytest

from studio_harness import SHARED, Studio, wait_for

pytestmark = pytest.mark.slow


def read_sse(client: httpx.Client, path: str, headers: dict | None = None,
             timeout: float = 600.0) -> list[dict]:
    """Read a whole SSE stream; returns [{"id", "event", "data"}] in order."""
    out, cur = [], {}
    with client.stream("GET", path, headers=headers or {}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                if "data" in cur:
                    cur["data"] = json.loads(cur["data"])
                    out.append(cur)
                cur = {}
                continue
            if line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            cur[key] = value[1:] if value.startswith(" ") else value
    return out


@pytest.fixture(scope="module")
def trained(studio: Studio) -> dict:
    """Upload real data with the openai client and fine-tune stories260K for 30 steps."""
    client = openai.OpenAI(base_url=f"{studio.url}/v1", api_key=studio.api_key, max_retries=0)
    with open(SHARED / "sft" / "oasst1_en_100_messages.jsonl", "rb") as fh:
        f = client.files.create(file=fh, purpose="fine-tune")
    assert f.id.startswith("file-") and f.bytes > 0
    f = client.files.wait_for_processing(f.id, poll_interval=0.5, max_wait_seconds=120)
    assert f.status == "processed"

    job = client.fine_tuning.jobs.create(
        model="stories260K", training_file=f.id,
        hyperparameters={"batch_size": 2, "learning_rate_multiplier": 10.0},
        extra_body={"max_steps": 30, "r": 8, "lora_alpha": 16, "max_seq_length": 256,
                    "gradient_accumulation_steps": 1, "warmup_ratio": 0.0,
                    "chat_template": "chatml", "seed": 7})
    assert job.id.startswith("ftjob-")
    assert job.status in ("validating_files", "queued", "running")
    with studio.client() as c:
        events = read_sse(c, f"/runs/{job.id}/events")
    return {"client": client, "job": job, "events": events}


def test_fine_tune_stories260k_through_the_openai_client(studio: Studio, trained: dict):
    client, job, events = trained["client"], trained["job"], trained["events"]
    assert client.fine_tuning.jobs.retrieve(job.id).id == job.id
    assert job.id in [j.id for j in client.fine_tuning.jobs.list(limit=10).data]
    assert events[-1]["event"] == "end", events[-5:]
    assert events[-1]["data"]["state"] == "succeeded", studio.tail_logs()
    ids = [int(e["id"]) for e in events if e.get("id")]
    assert ids == sorted(ids) and len(ids) == len(set(ids))
    metrics = [e["data"] for e in events if e["event"] == "metric" and "loss" in e["data"]]
    assert len(metrics) >= 20, metrics
    assert metrics[-1]["step"] == 30
    for key in ("learning_rate", "grad_norm", "tokens_per_second", "memory_gib"):
        assert key in metrics[-1], metrics[-1]
    first = sum(m["loss"] for m in metrics[:5]) / 5
    last = sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < first * 0.9, (first, last)

    # Last-Event-ID resume: only newer events come back.
    with studio.client() as c:
        resumed = read_sse(c, f"/runs/{job.id}/events", headers={"Last-Event-ID": str(ids[-3])})
    assert [int(e["id"]) for e in resumed if e.get("id")] == ids[-2:]

    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded"
    ev = client.fine_tuning.jobs.list_events(job.id, limit=100)
    steps = [e.data for e in ev.data if e.data and "loss" in e.data]
    assert steps and {"step", "loss", "learning_rate"} <= set(steps[0])

    # Download the adapter and config.json through the native API.
    with studio.client() as c:
        run = c.get(f"/api/runs/{job.id}").json()
        arts = {a["kind"]: a for a in run["artifacts"]}
        assert {"adapter", "config"} <= set(arts), run["artifacts"]
        cfg = c.get(arts["config"]["download_url"]).json()
        blob = c.get(arts["adapter"]["download_url"]).content
    assert cfg["spec"]["r"] == 8 and cfg["spec"]["max_steps"] == 30
    assert cfg["chat_template"]["name"] == "chatml"
    adapter_dir = studio.data_dir / "_downloaded_adapter"
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        z.extractall(adapter_dir)
    cfg_files = list(adapter_dir.rglob("adapter_config.json"))
    assert len(cfg_files) == 1, list(adapter_dir.rglob("*"))
    assert_adapter_changes_output(cfg_files[0].parent, studio)


def assert_adapter_changes_output(adapter_dir: Path, studio: Studio) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the API never shows server paths: the demo model's prepared folder is the one under models/
    base_dir = next((studio.data_dir / "models").glob("*/config.json")).parent
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    ids = tok("<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n",
              return_tensors="pt").input_ids
    gen = dict(max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        before = base.generate(ids, **gen)[0].tolist()
        tuned = PeftModel.from_pretrained(base, str(adapter_dir))
        after = tuned.generate(input_ids=ids, **gen)[0].tolist()
    lora = [n for n, _ in tuned.named_parameters() if "lora_B" in n]
    assert lora, "no LoRA weights loaded"
    assert before != after, "the adapter did not change the model's output"


def test_cancel_a_running_job(studio: Studio):
    client = openai.OpenAI(base_url=f"{studio.url}/v1", api_key=studio.api_key, max_retries=0)
    with open(SHARED / "sft" / "alpaca_en_demo.json", "rb") as fh:
        f = client.files.create(file=fh, purpose="fine-tune")
    client.files.wait_for_processing(f.id, poll_interval=0.5, max_wait_seconds=120)
    job = client.fine_tuning.jobs.create(model="stories260K", training_file=f.id,
                                         extra_body={"max_steps": 5000, "max_seq_length": 128,
                                                     "chat_template": "alpaca"})
    with studio.client() as c:
        wait_for(lambda: c.get(f"/api/runs/{job.id}").json()["state"] == "running", 120,
                 "the job to start", studio)
    client.fine_tuning.jobs.cancel(job.id)
    with studio.client() as c:
        state = wait_for(lambda: (s := c.get(f"/api/runs/{job.id}").json()["state"]) in
                         ("cancelled", "failed", "succeeded") and s, 30, "cancellation", studio)
    assert state == "cancelled"
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"


def test_openai_errors_have_the_openai_shape(studio: Studio):
    client = openai.OpenAI(base_url=f"{studio.url}/v1", api_key=studio.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as exc:
        client.fine_tuning.jobs.retrieve("ftjob-doesnotexist")
    assert "ftjob-doesnotexist" in str(exc.value)
    with pytest.raises(openai.NotFoundError) as exc:
        client.fine_tuning.jobs.create(model="no-such-model", training_file="file-nope")
    assert "no-such-model" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.fine_tuning.jobs.create(model="stories260K", training_file="file-nope",
                                       extra_body={"r": 0})
    assert exc.value.body["param"] and "r" in exc.value.body["param"], exc.value.body


@pytest.mark.parametrize("body", [
    {"format": "adapter"},
    {"format": "merged_16bit", "dtype": "bf16"},
    {"format": "gguf", "quantization": ["F16", "Q8_0", "Q4_K_M"]},
    {"format": "ollama", "quantization": "Q8_0"},
], ids=lambda b: b["format"])
def test_export_is_verified(studio: Studio, trained: dict, body: dict):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make setup")
    run_id = trained["job"].id
    with studio.client() as c:
        r = c.post(f"/api/runs/{run_id}/exports", json=body)
        assert r.status_code == 201, r.text
        export_id = r.json()["id"]
        info = wait_for(lambda: (x := c.get(f"/api/exports/{export_id}").json())["status"]
                        in ("succeeded", "failed", "cancelled") and x, 600, "the export", studio)
        assert info["status"] == "succeeded", (info["error"], info["verification"])
        assert info["verification"]["passed"] is True, info["verification"]
        assert info["files"], info
        for f in info["files"]:
            assert len(f["sha256"]) == 64 and f["size"] > 0
        names = [f["name"] for f in info["files"]]
        if body["format"] == "gguf":
            assert sum(n.endswith(".gguf") for n in names) == 3, names
            got = c.get(next(f["url"] for f in info["files"] if f["name"].endswith("Q8_0.gguf")))
            assert got.content[:4] == b"GGUF"
        if body["format"] == "ollama":
            assert "Modelfile" in [Path(n).name for n in names], names
            assert info["ollama"]["created"] is False and "ollama create" in info["ollama"]["command"]
        if body["format"] == "merged_16bit":
            assert any(n.endswith(".safetensors") for n in names), names
        listed = c.get(f"/api/runs/{run_id}/exports").json()["data"]
        assert export_id in [e["id"] for e in listed]
        z = c.get(f"/exports/{export_id}/download.zip")
        assert z.status_code == 200
        with zipfile.ZipFile(io.BytesIO(z.content)) as zf:
            assert sorted(zf.namelist()) == sorted(names)


def test_export_errors_are_clear(studio: Studio, trained: dict):
    with studio.client() as c:
        r = c.post(f"/api/runs/{trained['job'].id}/exports", json={"format": "onnx"})
        assert r.status_code == 422 and "format" in r.json()["error"]["message"]
        r = c.post("/api/runs/ftjob-nope/exports", json={"format": "gguf"})
        assert r.status_code == 404
        assert c.get("/api/exports/999999").status_code == 404
