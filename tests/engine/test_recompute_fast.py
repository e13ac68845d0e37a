"""Checkpointed backward without waste (reference path, fp32, CPU): the recompute skips the MLP down
projection (not for Gemma's sandwich norms), loss and every LoRA gradient stay those of the
un-checkpointed engine, and the skip is never active outside a recompute. The H2D prefetch itself
needs CUDA (tests/gpu/test_engine_gpu.py); here the disabled offloader must be a no-op.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from tests.engine.conftest import lora_grads, randomise_lora, spec, tiny_model
from worker.engine import checkpointing as ckpt
from worker.engine import engine, optim, patch, quant
from worker.engine.lora_ops import LoRAMLPFunction, make_proj


def _batch(seed=0, B=2, S=19):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (B, S), generator=g)
    mask = torch.ones_like(ids)
    mask[1, S - 5:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.fixture
def fetches(monkeypatch):
    """Counts dense-weight fetches (NF4 dequant or dense parameter) per base module (each base of
    a group fetch once, grouped dequant or not)."""
    seen = Counter()
    orig = quant.dense_weights

    def counted(bases, dtype):
        for b in bases:
            seen[id(b)] += 1
        return orig(bases, dtype)

    monkeypatch.setattr(quant, "dense_weights", counted)
    return seen


@pytest.fixture
def mlp_calls(monkeypatch):
    """need_y of every fused MLP call, in order."""
    calls = []
    orig = patch._mlp

    def spy(x, mlp, activation, impl, step=None, need_y=True, residual=None):
        calls.append(need_y)
        return orig(x, mlp, activation, impl, step, need_y, residual)

    monkeypatch.setattr(patch, "_mlp", spy)
    return calls


def _engine(base, checkpointing, nf4, **lora_kw):
    pm = engine.prepare(copy.deepcopy(base), spec(**lora_kw), load_in_4bit=nf4, impl="reference",
                        device="cpu", checkpointing=checkpointing)
    randomise_lora(pm)
    pm.train()
    return pm


def _steps(pm, n=2):
    """n AdamW steps; (loss, LoRA grads) of each."""
    opt = optim.make_optimizer(pm, "adamw_torch", lr=1e-2)
    out = []
    for step in range(n):
        ids, mask, labels = _batch(seed=step)
        loss = pm(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        out.append((loss.item(), lora_grads(pm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _mlp_bases(pm):
    """(gate, down) frozen base module of each layer."""
    return [tuple(getattr(m, "base_layer", m) for m in (l.mlp.gate_proj, l.mlp.down_proj))
            for l in pm.get_base_model().model.layers]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("nf4", [False, True])
def test_checkpointed_equals_plain_and_skips_down(arch, nf4, fetches, mlp_calls):
    base = tiny_model(arch)
    plain, ck = _engine(base, False, nf4), _engine(base, True, nf4)
    ref = _steps(plain)
    fetches.clear()
    mlp_calls.clear()
    got = _steps(ck)
    for (lr, gr), (lc, gc) in zip(ref, got):
        assert abs(lr - lc) <= 1e-6, (lr, lc)
        assert gr.keys() == gc.keys() and len(gr) > 0
        assert max((gr[k] - gc[k]).abs().max().item() for k in gr) <= 1e-6
    sandwich = arch == "gemma2"
    # per step and layer: forward, [recompute], backward
    for gate, down in _mlp_bases(ck):
        assert fetches[id(gate)] == 2 * 3
        assert fetches[id(down)] == 2 * (3 if sandwich else 2), arch
        if nf4:
            assert isinstance(down, quant.NF4Linear) and down.dequants == fetches[id(down)]
    # two steps, each: forward L0, L1 (need_y), recompute L1, L0 (skip unless sandwich)
    assert mlp_calls == 2 * [True, True, sandwich, sandwich]
    assert not ckpt.recomputing()


@pytest.mark.parametrize("targets", [["q_proj", "gate_proj"], ["v_proj", "down_proj"]])
def test_partial_targets(targets, fetches):
    """down_proj without LoRA (H not even computed in the skip) or with LoRA alone."""
    base = tiny_model("llama")
    ref = _steps(_engine(base, False, True, target_modules=targets, use_rslora=True), 1)
    ck = _engine(base, True, True, target_modules=targets, use_rslora=True)
    fetches.clear()
    got = _steps(ck, 1)
    (lr, gr), (lc, gc) = ref[0], got[0]
    assert abs(lr - lc) <= 1e-6 and gr.keys() == gc.keys() and len(gr) > 0
    assert max((gr[k] - gc[k]).abs().max().item() for k in gr) <= 1e-6
    assert all(fetches[id(down)] == 2 for _, down in _mlp_bases(ck))


def test_kept_layers_and_eval_do_not_skip(monkeypatch, mlp_calls):
    """A budget-kept layer and an eval (no-grad) forward run the whole MLP."""
    base = tiny_model("qwen3")
    plain, ck = _engine(base, False, False), _engine(base, True, False)
    monkeypatch.setattr(engine, "_kept_layers", lambda *a: 1)
    ref, got = _steps(plain, 1), _steps(ck, 1)
    assert abs(ref[0][0] - got[0][0]) <= 1e-6
    assert ck.get_base_model()._whetstone.kept_layers == 1
    assert mlp_calls[-3:] == [True, True, False]  # L0 kept, L1 checkpointed, L1 recomputed
    mlp_calls.clear()
    ids, mask, labels = _batch()
    ck.eval()
    with torch.no_grad():
        loss = ck(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert mlp_calls == [True, True] and torch.isfinite(loss)


@pytest.mark.parametrize("cache", [False, True])
def test_mlp_function_skip_and_residual_give_the_same_gradients(cache):
    """LoRAMLPFunction under ``h + m``: need_y False, and the residual h added inside the down GEMM
    (need_y True and False), give the dX, dh, dA, dB of need_y True with the add outside; the
    residual form's value is h + m. With a CastCache the casts are made once and reused."""
    torch.manual_seed(0)
    mlp = tiny_model("llama").model.layers[0].mlp
    from peft import LoraConfig, get_peft_model

    from worker.engine.lora_ops import CastCache

    wrapped = get_peft_model(torch.nn.Sequential(mlp), LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]))
    randomise_lora(wrapped)
    mods = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    projs, ab = zip(*(make_proj(m) for m in mods))
    ab = [t for pair in ab for t in pair]
    x = torch.randn(2, 5, 64)
    dout = torch.randn(2, 5, 64)
    casts = CastCache() if cache else None
    res, values = [], []
    for need_y, fused in ((True, False), (False, False), (True, True), (False, True)):
        X = x.clone().requires_grad_(True)
        h = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = LoRAMLPFunction.apply(X, projs, "silu", "reference", need_y, casts, h if fused else None,
                                  *ab)
        assert y.shape == (2, 5, 64) and y.dtype == x.dtype
        out = y if fused else h + y
        if need_y:
            values.append(out.detach())
        res.append(torch.autograd.grad(out, [X, h, *ab], dout))
    torch.testing.assert_close(values[0], values[1], rtol=1e-6, atol=1e-6)
    for other in res[1:]:
        for a, b in zip(res[0], other):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if cache:
        assert len(casts._d) == 2  # gate/up and down, each cast once for the four calls


def test_disabled_offloader_is_a_no_op():
    off = ckpt.Offloader(enabled=False)
    assert not off.enabled and off.stream is None and off.h2d is None
    off.start_chain()
    h = torch.randn(2, 3, 4)
    handles = [off.save(i, h + i) for i in range(3)]
    assert all(off.load(hd).equal(h + i) for i, hd in reversed(list(enumerate(handles))))
    assert off.load(off.save(0, h)) is h and off.prefetches == 0 and off.pool.allocs == 0
