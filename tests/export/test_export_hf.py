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
