"""The LoRA term merged into the NF4 dequantisation (quant.can_merge / lora_ops._merges), CPU, fp32.

Y = X (W + s B A)^T and dX = dY (W + s B A) must give the loss and every LoRA gradient of the
separate LoRA term (WHETSTONE_NF4_LORA_MERGE=0, quant.LORA_MERGE False) over two AdamW steps with
checkpointing; merged weights are built for exactly the NF4 projections whose in_features is a
multiple of the blocksize (a dense base, or down_proj with in 96, keeps the separate term)."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from tests.engine.conftest import lora_grads, randomise_lora, spec, tiny_config
from worker.engine import engine, optim, quant


def _model(intermediate):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.intermediate_size = intermediate
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 16:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _train(base, nf4, merge, monkeypatch, merged):
    monkeypatch.setattr(quant, "LORA_MERGE", merge)
    pm = engine.prepare(copy.deepcopy(base), spec(use_rslora=True), load_in_4bit=nf4, impl="reference",
                        device="cpu", checkpointing=True)
    randomise_lora(pm)
    pm.train()
    opt = optim.make_optimizer(pm, "adamw_torch", lr=1e-2)
    out = []
    for step in range(2):
        merged.clear()
        ids, mask, labels = _batch(step)
        loss = pm(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        out.append((loss.item(), lora_grads(pm), Counter(merged)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out, pm


def _eval_loss(pm, merge, monkeypatch):
    """Loss of a no-grad eval forward with labels (the fused path without autograd nodes, XA
    skipped where merged; as evaluation runs it)."""
    monkeypatch.setattr(quant, "LORA_MERGE", merge)
    pm.eval()
    ids, mask, labels = _batch(5)
    with torch.no_grad():
        return pm(input_ids=ids, attention_mask=mask, labels=labels).loss.item()


@pytest.fixture
def merged(monkeypatch):
    """(out_features, in_features) of every merged weight built."""
    seen = []
    orig = quant.merged_weight

    def spy(base, A, Bs, dtype):
        seen.append((base.out_features, base.in_features))
        return orig(base, A, Bs, dtype)

    monkeypatch.setattr(quant, "merged_weight", spy)
    return seen


@pytest.mark.parametrize("intermediate", [128, 96])
def test_merged_lora_term_gives_the_separate_terms_loss_and_gradients(intermediate, merged, monkeypatch):
    base = _model(intermediate)
    (sep, _), (mer, pm) = (_train(base, True, m, monkeypatch, merged) for m in (False, True))
    # first step: the same loss and LoRA gradients up to fp32 summation order (the merged weight
    # is rounded once from W + s B A); second step: the same loss (AdamW turns the gradients'
    # last-bit differences into visible ones only where a gradient is ~0, so they are not compared)
    (ls, gs, _), (lm, gm, _) = sep[0], mer[0]
    assert abs(ls - lm) <= 1e-6 * abs(ls), (ls, lm)
    assert gs.keys() == gm.keys() and len(gs) == 2 * 7 * 2
    for k in gs:
        scale = gs[k].abs().max().item()
        assert (gs[k] - gm[k]).abs().max().item() <= 2e-4 * scale, k
    assert abs(sep[1][0] - mer[1][0]) <= 1e-4 * abs(sep[1][0])
    # per layer (2) and step: q, k, v, gate, up in forward, recompute (attention is recomputed
    # here: no stash on the CPU) and backward; o and down (only when in % 64 == 0) in forward and
    # backward (their recomputed outputs are not needed)
    want = {(64, 64): 2 * 3 + 2 * 2, (32, 64): 2 * 2 * 3, (intermediate, 64): 2 * 2 * 3}
    if intermediate % 64 == 0:
        want[(64, intermediate)] = 2 * 2
    for _, _, n_sep in sep:
        assert n_sep == Counter()
    for _, _, n_mer in mer:
        assert n_mer == Counter(want), n_mer
    merged.clear()
    with_merge = _eval_loss(pm, True, monkeypatch)
    assert len(merged) == 2 * (6 + (intermediate % 64 == 0))  # each projection once a layer
    assert abs(with_merge - _eval_loss(pm, False, monkeypatch)) <= 1e-6 * abs(with_merge)


def test_dense_bases_and_held_dense_weights_keep_the_separate_term(merged, monkeypatch):
    base = _model(128)
    _train(base, False, True, monkeypatch, merged)
    assert merged == []
    pm = engine.prepare(copy.deepcopy(base), spec(), load_in_4bit=True, impl="reference", device="cpu")
    q = pm.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert quant.can_merge(q, 16) and not quant.can_merge(q, 129)
    q.cache_dense()  # generation holds the dense W: merging would dequantise again
    assert not quant.can_merge(q, 16)
    monkeypatch.setattr(quant, "LORA_MERGE", False)
    q.drop_dense()
    assert not quant.can_merge(q, 16)
