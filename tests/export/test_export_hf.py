"""Adapter and merged 16-bit exports of a stories260K LoRA run, verified against base+adapter."""
from __future__ import annotations

import json

import pytest

from worker.jobs.export import export_run


def stages(seen: list) -> list[str]:
    """The stage names in order (each once); the fractions never go back."""
    fracs = [round(f, 9) for _, f in seen]  # the job reports thousandths
    assert fracs == sorted(fracs) and fracs[-1] == 1.0, seen
    return list(dict.fromkeys(st for st, _ in seen))


def test_adapter_export_verified(run_dir, tmp_path):
    seen = []
    res = export_run(run_dir, {"run_id": "r", "format": "adapter"}, tmp_path,
                     lambda st, f: seen.append((st, f)))
    assert res["verification"]["passed"], res["verification"]
    assert stages(seen) == ["reference", "copy", "verify adapter", "done"]
    names = {f["name"] for f in res["files"]}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors",
            "adapter/tokenizer.json", "adapter/chat_template.jinja"} <= names
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in res["files"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_merged_export_verified(run_dir, tmp_path, dtype):
    seen = []
    res = export_run(run_dir, {"run_id": "r", "format": "merged_16bit", "dtype": dtype}, tmp_path,
                     lambda st, f: seen.append((st, f)))
    assert res["verification"]["passed"], res["verification"]
    assert stages(seen) == ["reference", "load", "merge", "save", "verify merged", "done"]
    folder = tmp_path / f"merged-{dtype}"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    from safetensors import safe_open
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys  # tied: written once
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == \
            {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
    gen = json.loads((folder / "generation_config.json").read_text())
    assert 2 in gen["eos_token_id"]  # </s> ends a turn in the run's template
    assert res["merged"]["end_of_turn"] == ["</s>"]


def test_merge_changes_weights(run_dir, stories_hf, tmp_path):
    """The LoRA delta really is in the merged weights (B is non-zero)."""
    import torch
    from safetensors.torch import load_file
    export_run(run_dir, {"run_id": "r", "format": "merged_16bit", "dtype": "fp16"}, tmp_path)
    merged = load_file(tmp_path / "merged-fp16" / "model.safetensors")
    base = load_file(stories_hf / "model.safetensors")
    k = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[k].float() - base[k].float()).abs().max() > 1e-3


def test_nf4_roundtrip_is_a_projection():
    import torch
    from worker.export.merged import nf4_roundtrip
    w = torch.randn(64, 172)
    q = nf4_roundtrip(w)
    assert torch.equal(nf4_roundtrip(q), q)  # idempotent: values already on the grid
    err = (q - w).abs().view(-1)
    assert err.max() < 0.2 * w.abs().max()
    assert len(torch.unique(q.view(-1, 64)[0])) <= 16


@pytest.mark.parametrize("config_dtype, stored, want, why", [
    ("bfloat16", "F32", "bf16", "the base model's weights are bf16"),
    ("float16", "F32", "fp16", "the base model's weights are fp16"),
    (None, "BF16", "bf16", "the base model's weights are bf16"),  # no dtype in config.json
    ("float32", "F32", "bf16", "the base model's weights are fp32 and a merged 16-bit export "
                               "is 16-bit")])
def test_merged_dtype_is_16_bit(tmp_path, config_dtype, stored, want, why):
    """The default merged dtype: the base's own 16-bit dtype (config.json, else the stored
    tensors), bf16 for an fp32 base; an explicit request wins."""
    import torch
    from safetensors.torch import save_file

    from worker.export.merged import merged_dtype
    cfg = {"model_type": "llama", **({"dtype": config_dtype} if config_dtype else {})}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[stored]
    save_file({"a.int": torch.zeros(2, dtype=torch.int64), "b": torch.zeros(2, dtype=torch_dtype)},
              tmp_path / "model.safetensors")
    dtype, reason = merged_dtype(tmp_path)
    assert dtype == want and reason.startswith(why), reason
    assert merged_dtype(tmp_path, "fp32") == ("fp32", "fp32 was requested")
