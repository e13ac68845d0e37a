"""``add_template_tokens`` end to end on the CPU: a run created over /api on the real
stories260K (a llama2.c base whose 512-token vocabulary has no ChatML markers), the real
``train`` job (in-process worker loop) adds ``<|im_start|>``/``<|im_end|>`` as tokens, logs
them, encodes the data with them, trains their embedding rows (PEFT ``trainable_token_indices``)
and saves the extended tokenizer with the adapter; the merged export (a real export job) has the
new vocabulary and greedy generation stops at the new end-of-turn token."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.store import events, queue, repo
from app.store.schema import JobState
from tests.conftest import SHARED_DATA, STORIES
from tests.worker.conftest import inline_studio

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(),
                                reason=f"no test data at {SHARED_DATA}")
ANSWER = "Once upon a time"
MARKERS = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("addtok")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]}
            for q in ("Hi", "Hello?", "Tell me a story", "Hey you", "Who are you?", "Go on")]
    data = d / "hello_chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with inline_studio(d / "data", [data], "w-addtok") as studio:
        c, w = studio["client"], studio["worker"]
        model = repo.get_model(w.engine, "stories260K")
        page = c.get(f"/runs/new?model={model.id}").text  # the form names what would be added
        assert 'name="add_template_tokens"' in page
        assert "<code>&lt;|im_start|&gt;</code>, <code>&lt;|im_end|&gt;</code>" in page
        spec = {"model": "stories260K", "dataset": studio["ids"][data.name],
                "chat_template": "chatml", "add_template_tokens": True, "max_steps": 25,
                "learning_rate": 1e-2, "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
                "per_device_train_batch_size": 6, "gradient_accumulation_steps": 1,
                "max_seq_length": 128, "r": 8, "lora_alpha": 16, "save_steps": 1000}
        r = c.post("/api/runs", json=spec)
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        w.serve(once=True)
        run = repo.get_run(w.engine, run_id)
        job = queue.get_job(w.engine, run.job_id)
        assert job.state == JobState.SUCCEEDED, job.error
        yield {**studio, "run_id": run_id, "job": job, "model": model}


def test_the_run_adds_the_template_tokens_and_the_adapter_carries_them(trained):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    c, job = trained["client"], trained["job"]
    base_tok = AutoTokenizer.from_pretrained(trained["model"].path)
    n = len(base_tok)
    assert n == 512 and all(base_tok.convert_tokens_to_ids(t) in (None, base_tok.unk_token_id)
                            for t in MARKERS)
    events = c.get(f"/v1/fine_tuning/jobs/{trained['run_id']}/events",
                   params={"limit": 1000}).json()["data"]
    logs = [e["message"] for e in events]
    assert any(f"added 2 special tokens to the tokenizer: <|im_start|> (id {n}), <|im_end|> "
               f"(id {n + 1}); vocabulary {n + 2}" in m for m in logs), logs
    adapter = Path(job.result["adapter_dir"])
    tok = AutoTokenizer.from_pretrained(adapter)
    assert len(tok) == n + 2 and tok.convert_tokens_to_ids(MARKERS) == [n, n + 1]
    assert "were added (`add_template_tokens`)" in (adapter / "README.md").read_text()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["trainable_token_indices"] == {"embed_tokens": [n, n + 1]}
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    delta = weights["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    assert tuple(delta.shape) == (2, 64)  # the two new rows (the tied head reads them too)
    base = load_file(str(Path(trained["model"].path) / "model.safetensors"))
    mean = base["model.embed_tokens.weight"].mean(dim=0)  # where the new rows started
    assert float((delta - mean).abs().max()) > 1e-2  # ... and training moved them
    assert not any(k.endswith("base_layer.weight") for k in weights)  # not the whole embedding
    # the dataset was encoded with the new tokens: <|im_start|> is one token
    conf = json.loads((adapter.parent / "config.json").read_text())
    assert conf["spec"]["add_template_tokens"] is True
    assert json.loads((adapter.parent / "tokenizer" / "tokenizer.json").read_text())


def test_the_merged_export_has_the_new_vocabulary_and_stops_at_im_end(trained):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    c, w = trained["client"], trained["worker"]
    r = c.post(f"/api/runs/{trained['run_id']}/exports", json={"format": "merged_16bit"})
    assert r.status_code == 201, r.text
    w.serve(once=True)
    ej = queue.get_job(w.engine, r.json()["id"])
    assert ej.state == JobState.SUCCEEDED, ej.error
    assert ej.result["verification"]["passed"], ej.result["verification"]
    config = next(f["path"] for f in ej.result["files"] if f["name"].endswith("/config.json"))
    folder = Path(config).parent
    mtok = AutoTokenizer.from_pretrained(folder)
    end = mtok.convert_tokens_to_ids("<|im_end|>")
    assert len(mtok) == 514 and end == 513
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 514
    # "merged 16-bit" is 16-bit: the demo base is fp32, so every tensor is written as bf16,
    # and the job's log, the export's record and the model card say which and why
    from safetensors import safe_open
    merged = ej.result["merged"]
    assert (merged["dtype"], merged["dtype_from"], folder.name) == ("bf16", "default",
                                                                     "merged-bf16")
    with safe_open(folder / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    why = "the base model's weights are fp32 and a merged 16-bit export is 16-bit"
    assert f"saved as bfloat16 ({why}" in (folder / "README.md").read_text()
    logs = [e.data["message"] for e in events.since(w.engine, ej.id, types=["log"])]
    assert any(m.startswith(f"merged weights written as bf16: {why}") for m in logs), logs
    assert c.get(f"/api/exports/{ej.id}").json()["dtype"] == "bf16"
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.get_input_embeddings().weight.shape[0] == 514
    text = mtok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                    add_generation_prompt=True)
    ids = mtok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 512  # <|im_start|> is one token of the merged tokenizer
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                             eos_token_id=end)[0, len(ids):].tolist()
    assert out[-1] == end and len(out) < 24, mtok.decode(out)  # stopped at the new token
    assert mtok.decode(out[:-1]).strip() == ANSWER
    # the same greedy tokens as fp32 base + adapter (PEFT, unmerged); the bf16 weights (computed
    # in fp32) keep the reference's top-k logits within the rounding verification allows
    from worker.export.run import load_run, load_trained_model
    from worker.export.verify import LOGIT_TOL, TOP_K, logit_error
    run = repo.get_run(w.engine, trained["run_id"])
    ref = load_trained_model(load_run(run.output_dir, trained["model"].path, run.spec),
                             dtype=torch.float32)
    model32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(input_ids=torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                            eos_token_id=end)[0, len(ids):].tolist()
        seq = torch.tensor([ids + out])
        got_logits, want_logits = model32(seq).logits[0], ref(input_ids=seq).logits[0]
    assert out == want
    tops = [[[int(i), float(row[i])] for i in row.topk(TOP_K).indices] for row in want_logits]
    assert 0 < logit_error(tops, got_logits) < LOGIT_TOL["bfloat16"]
    # the adapter export reloads base + adapter at the new size and verifies the same answers
    r = c.post(f"/api/runs/{trained['run_id']}/exports", json={"format": "adapter"})
    w.serve(once=True)
    ej = queue.get_job(w.engine, r.json()["id"])
    assert ej.state == JobState.SUCCEEDED and ej.result["verification"]["passed"], ej.error


def test_the_run_form_sets_add_template_tokens(trained):
    """The form's checkbox reaches the stored spec (unchecked: the default, False)."""
    c, w = trained["client"], trained["worker"]
    form = {"model": trained["model"].id,
            "dataset": repo.get_run(w.engine, trained["run_id"]).spec["dataset"],
            "r": "8", "lora_alpha": "16", "lora_dropout": "0", "max_seq_length": "128",
            "learning_rate": "1e-2", "num_train_epochs": "1", "max_steps": "5",
            "per_device_train_batch_size": "2", "gradient_accumulation_steps": "1",
            "warmup_ratio": "0", "lr_scheduler_type": "linear", "seed": "1",
            "chat_template_choice": "chatml", "target_modules": ["q_proj", "v_proj"]}
    for checked in (True, False):
        extra = {"add_template_tokens": "true"} if checked else {}
        r = c.post("/runs", data={**form, **extra}, follow_redirects=False)
        assert r.status_code == 303, r.text
        run_id = r.headers["location"].rsplit("/", 1)[1]
        assert repo.get_run(w.engine, run_id).spec["add_template_tokens"] is checked
        assert c.post(f"/api/runs/{run_id}/cancel").status_code == 200


def test_a_gpu_run_with_added_tokens_trains_without_the_kernel_engine(monkeypatch):
    """The kernel engine cannot train added rows: on a CUDA worker the job (its own child
    process) switches to transformers + PEFT and says so, so the run does not fail at start."""
    from types import SimpleNamespace

    from app.store.specs import TrainSpec
    from worker.engine import sft
    from worker.jobs.added_tokens import use_transformers

    logs: list[tuple] = []
    ctx = SimpleNamespace(log=lambda *a: logs.append(a))
    spec = TrainSpec(model="m", dataset="d", add_template_tokens=True)
    monkeypatch.setenv("WHETSTONE_ENGINE", "1")  # restored after the test
    use_transformers(ctx, spec.model_copy(update={"add_template_tokens": False}), True)
    assert sft.use_engine(True) and not logs  # the option off: the engine trains
    use_transformers(ctx, spec, False)
    assert sft.use_engine(True) and not logs  # on the CPU there is no engine to leave
    use_transformers(ctx, spec, True)
    assert not sft.use_engine(True)
    assert logs == [("add_template_tokens: the kernel engine does not train added token rows; "
                     "this run trains with transformers + PEFT (trainable_token_indices)",
                     "warning")]
