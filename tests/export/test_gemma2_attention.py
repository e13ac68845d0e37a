"""Gemma 2 is loaded with eager attention wherever the worker runs it in transformers (training on
the CPU, the export's reference, the merged reload): transformers' sdpa ignores its attention
soft-cap, which llama.cpp and the CUDA engine apply (worker/hf_attention.py)."""
from __future__ import annotations

import pytest

from tests.export.chat_models import chat_tokenizer, save_base, tiny_model
from tests.export.conftest import need_data


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Gemma 2 whose attention scores reach the soft-cap (q, k scaled up), and a Qwen2's
    config.json."""
    need_data()
    import torch

    root = tmp_path_factory.mktemp("attn")
    tok = chat_tokenizer("gemma")
    gemma = tiny_model("gemma2", len(tok), tok.bos_token_id, tok.eos_token_id,
                       pad_id=tok.convert_tokens_to_ids("<pad>"))
    with torch.no_grad():
        for layer in gemma.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    tiny_model("qwen2", 512, None, 2).config.save_pretrained(root / "qwen2")
    return save_base(gemma, tok, root / "gemma2"), root / "qwen2"


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_gemma2_loads_eager_and_keeps_its_softcap(folders):
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.sft import load_model
    from worker.hf_attention import attn_kwargs

    gemma, qwen = folders
    assert attn_kwargs(gemma) == {"attn_implementation": "eager"}
    assert attn_kwargs(qwen) == {} and attn_kwargs(gemma / "missing") == {}
    trained_as = load_model(str(gemma), False, False)
    assert trained_as.config._attn_implementation == "eager"
    ids = list(range(5, 40))
    sdpa = AutoModelForCausalLM.from_pretrained(gemma, attn_implementation="sdpa").eval()
    eager = AutoModelForCausalLM.from_pretrained(gemma, attn_implementation="eager").eval()
    # the cap is tanh(s / 50) * 50: with scores this large, leaving it out changes the logits
    gap = (_logits(sdpa, ids) - _logits(eager, ids)).abs().max().item()
    assert gap > 1e-2, gap
    assert torch.equal(_logits(trained_as.eval(), ids), _logits(eager, ids))
