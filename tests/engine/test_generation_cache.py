"""Generation with NF4 bases held dense for the phase (worker.engine.gencache), CPU reference path.

Greedy decoding with the cache equals decoding without it, token for token (stories260K and a tiny
random Llama, both NF4); each NF4 weight is dequantised once per phase instead of once per decode
step; the cache respects its byte limit, caches nothing without a VRAM budget and is freed on exit.
"""
from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import randomise_lora, spec, stories_nf4, tiny_model
from worker.engine import engine
from worker.engine.gencache import cache_limit, dense_generation, generation_reserve, nf4_modules

NEW = 12


def _greedy(pm, ids, mask):
    with torch.no_grad():
        return pm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                           do_sample=False, min_new_tokens=NEW, pad_token_id=0)


def _dequants(pm):
    return sum(m.dequants for m in nf4_modules(pm))


def _check(pm, ids, mask):
    mods = nf4_modules(pm)
    assert mods
    n0 = _dequants(pm)
    plain = _greedy(pm, ids, mask)
    per_phase_plain = _dequants(pm) - n0
    assert per_phase_plain >= len(mods) * NEW  # every decode step dequantises every weight
    n0 = _dequants(pm)
    with dense_generation(pm, limit=1 << 40) as stats:
        cached = _greedy(pm, ids, mask)
    assert stats.cached == stats.total == len(mods)
    assert _dequants(pm) - n0 == len(mods)  # once each, for the whole phase
    assert torch.equal(plain, cached), (plain, cached)
    assert all(m._dense is None for m in mods)  # freed before the training pass
    return plain


def test_stories260k_nf4_greedy_equal(stories_hf):
    pm, ids, mask = stories_nf4(stories_hf)
    out = _check(pm, ids, mask)
    assert out.shape == (2, 6 + NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_nf4_greedy_equal_and_partial_cache(arch):
    pm = engine.prepare(tiny_model(arch), spec(), load_in_4bit=True, impl="reference",
                        device="cpu")
    randomise_lora(pm)
    pm.eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 96, (2, 5), generator=g)
    mask = torch.ones_like(ids)
    plain = _check(pm, ids, mask)
    mods = nf4_modules(pm)
    half = sum(m.dense_bytes() for m in mods[: len(mods) // 2])
    with dense_generation(pm, limit=half) as stats:
        assert stats.bytes <= half and 0 < stats.cached < stats.total
        assert torch.equal(_greedy(pm, ids, mask), plain)
    assert all(m._dense is None for m in mods)


def test_budget_planning():
    pm = engine.prepare(tiny_model("llama"), spec(), load_in_4bit=True, impl="reference",
                        device="cpu")
    with dense_generation(pm, None) as stats:  # no budget: least memory, nothing held
        assert stats.cached == 0 and stats.total > 0
    assert cache_limit(None) == 0
    assert cache_limit(2.0, reserve=1 << 30) == (1 << 30) - (torch.cuda.memory_allocated()
                                                             if torch.cuda.is_available() else 0)
    assert cache_limit(0.5, reserve=1 << 30) == 0
    with dense_generation(pm, 64.0) as stats:  # a roomy budget holds every weight
        assert stats.cached == stats.total
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256)
    # 8 rollouts of 256 + 256 tokens, bf16: 0.5 GiB of KV cache + logits + 1 GiB margin
    r = generation_reserve(cfg, 8, 512, 2)
    assert r == 2 * 32 * 8 * 512 * 1024 * 2 + 2 * 8 * 128256 * 4 + (1 << 30)


def test_cache_is_dropped_on_error():
    pm = engine.prepare(tiny_model("llama"), spec(), load_in_4bit=True, impl="reference",
                        device="cpu")
    with pytest.raises(RuntimeError):
        with dense_generation(pm, limit=1 << 40):
            raise RuntimeError("generation failed")
    assert all(m._dense is None for m in nf4_modules(pm))
