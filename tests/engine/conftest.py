"""Tiny random-init fp32 models and helpers for the engine equivalence tests (CPU, CI)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                              "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32})
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=8)
    if arch == "gemma2":
        c = dict(common, tie_word_embeddings=True)
        return tf.Gemma2Config(**c, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if arch == "gemma3":
        c = dict(common, tie_word_embeddings=True)
        return tf.Gemma3TextConfig(**c, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"])
    raise KeyError(arch)


def tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    attn = "eager" if arch == "gemma2" else "sdpa"
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # norms away from their init so (1 + w) vs w matters
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def spec(**kw):
    d = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ALL7, use_rslora=False)
    d.update(kw)
    return SimpleNamespace(**d)


def randomise_lora(pm, seed=1):
    """LoRA B starts at zero in PEFT; give every A and B deterministic non-zero values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(pm.named_parameters()):
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def nf4_roundtrip_(model, targets=ALL7):
    """Replace target linear weights by their NF4 dequantisation (the reference).

    Quantised by bitsandbytes; dequantised by whetstone_kernels.nf4_ref (bit-exact with bitsandbytes' format
    and tested against it), because bitsandbytes 0.50.2's CPU ``dequantize_4bit`` returns wrong
    values for some shapes (e.g. [64, 96]: max error 2.0 where the NF4 error is 0.46).
    """
    import bitsandbytes.functional as bnbf

    from whetstone_kernels.nf4_ref import nf4_dequantize_ref, nf4_state_from_bnb

    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                p, qs = bnbf.quantize_4bit(mod.weight.data, blocksize=64, compress_statistics=True,
                                           quant_type="nf4")
                mod.weight.copy_(nf4_dequantize_ref(p, nf4_state_from_bnb(qs), torch.float32))


def lora_grads(pm):
    return {n: p.grad.detach().clone() for n, p in pm.named_parameters() if "lora_" in n}


@pytest.fixture
def clone():
    return copy.deepcopy


def stories_nf4(stories_hf):
    """stories260K (fp32, CPU) prepared by the engine with NF4 bases and non-zero LoRA, eval mode,
    plus two left-padded prompts: (model, ids [2, 6], attention_mask [2, 6])."""
    from transformers import AutoModelForCausalLM

    from worker.engine import engine

    model = AutoModelForCausalLM.from_pretrained(str(stories_hf), dtype=torch.float32)
    pm = engine.prepare(model, spec(r=4, lora_alpha=8), load_in_4bit=True, impl="reference",
                        device="cpu")
    randomise_lora(pm)
    pm.eval()
    ids = torch.tensor([[1, 403, 407, 261, 378, 30], [0, 0, 1, 403, 407, 261]])
    mask = (torch.arange(6)[None] >= torch.tensor([[0], [2]])).long()
    return pm, ids, mask
