"""GRPO log-probs through the engine (reference path, fp32, CPU) vs plain transformers + PEFT.

Policy and reference (adapter disabled) per-token log-probs of the completion, and the gradient of
a weighted sum of the policy's w.r.t. every LoRA A/B, on left-padded prompts + right-padded
completions; tiny Llama and Qwen3, dense and NF4 bases. The engine path is proven taken: its
``fused_calls`` counter rises and no PEFT LoRA module's own forward runs.
"""
from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model

from tests.engine.conftest import lora_grads, nf4_roundtrip_, randomise_lora, spec, tiny_model
from worker.engine import engine
from worker.engine.logps import policy_logps

TOL = 1e-5
K = 7  # completion tokens scored
TEMP = 0.8


def _pair(arch, nf4):
    base = tiny_model(arch)
    ref_base = copy.deepcopy(base)
    if nf4:
        nf4_roundtrip_(ref_base)
    ref = get_peft_model(ref_base, engine.lora_config(spec()))
    eng = engine.prepare(base, spec(), load_in_4bit=nf4, impl="reference", device="cpu")
    for m in (ref, eng):
        randomise_lora(m)
        m.train()
    return ref, eng


def _batch():
    """3 rows of prompt (left-padded, up to 6) + completion (K, right-padded after an EOS)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 96, (3, 6 + K), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding of a shorter prompt
    mask[2, :4] = 0
    mask[0, -3:] = 0  # a completion that ended early
    mask[2, -1:] = 0
    return ids, mask


def _hf_logps(model, ids, mask):
    """The definition: full logits of plain HF + PEFT, shifted, temperature, log-softmax."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -K - 1:-1] / TEMP
    lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -K:, None]).squeeze(-1)
    return lp.masked_fill(mask[:, -K:] == 0, 0.0)


def _lora_forward_calls(pm):
    """Counts calls of the PEFT LoRA modules' own forward (the unfused path)."""
    from peft.tuners.lora import LoraLayer

    calls = [0]
    for m in pm.modules():
        if isinstance(m, LoraLayer):
            m.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("nf4", [False, True])
def test_policy_and_reference_logps_and_grads(arch, nf4):
    ref, eng = _pair(arch, nf4)
    st = engine.engine_state(eng)
    assert st is not None
    calls = _lora_forward_calls(eng)
    ids, mask = _batch()
    w = torch.linspace(-1.0, 2.0, 3 * K).view(3, K)  # advantage-like per-token weights

    lr = _hf_logps(ref, ids, mask)
    (lr * w).sum().backward()
    before = st.fused_calls
    le, ent = policy_logps(eng, ids, mask, K, TEMP, batch_size=2, entropy=True)
    assert st.fused_calls == before + 2  # two micro-batches, both through the fused layers
    (le * w).sum().backward()
    assert calls[0] == 0  # no PEFT LoRA module ran its own forward
    assert le.shape == (3, K) and ent.shape == (3, K)
    assert (le - lr).abs().max().item() <= TOL
    gr, ge = lora_grads(ref), lora_grads(eng)
    assert gr.keys() == ge.keys() and gr
    # relative to the largest gradient (here ~5): fp32 sums in another order differ by ~1e-6 of it
    gmax = max(g.abs().max().item() for g in gr.values())
    assert max((gr[k] - ge[k]).abs().max().item() for k in gr) <= TOL * max(1.0, gmax)
    assert gmax > 1e-3

    with torch.no_grad():  # the reference policy: the adapter-disabled base
        with ref.disable_adapter():
            rr = _hf_logps(ref, ids, mask)
        before = st.fused_calls
        with eng.disable_adapter():
            re_, _ = policy_logps(eng, ids, mask, K, TEMP)
        assert st.fused_calls == before + 1 and calls[0] == 0
    assert (re_ - rr).abs().max().item() <= TOL
    assert (re_ - le.detach()).abs().max().item() > 1e-3  # the adapter does change the policy


def test_disabled_adapter_is_base_only_projection():
    from worker.engine.lora_ops import lora_params

    eng = engine.prepare(tiny_model("llama"), spec(), impl="reference", device="cpu")
    q = eng.get_base_model().model.layers[0].self_attn.q_proj
    assert lora_params(q) is not None
    with eng.disable_adapter():
        assert lora_params(q) is None
    assert lora_params(q) is not None
