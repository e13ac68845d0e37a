"""Fused attention with a hand-held backward, and the checkpoint stash that lets a recompute skip
attention and the q/k/v/o base projections (reference path, CPU, fp32/fp64).

The checkpointed engine must give the plain engine's loss and every LoRA gradient while its
recompute calls the attention forward kernel zero times and fetches the q/k/v/o weights only for the
forward and the backward. Unpadded batches (plain causal attention) take the stash path; a padded
batch (masked attention) must keep recomputing.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from tests.engine.conftest import lora_grads, randomise_lora, spec, tiny_model
from worker.engine import attention as attn_mod
from worker.engine import checkpointing as ckpt
from worker.engine import engine, optim, quant


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("B,Hq,Hk,S,D", [(1, 4, 4, 1, 8), (2, 4, 2, 7, 8), (3, 6, 3, 13, 16),
                                         (2, 8, 1, 33, 4)])
def test_sdpa_function_matches_autograd_sdpa(B, Hq, Hk, S, D, dtype, tol):
    g = torch.Generator().manual_seed(S * 7 + Hq)
    # q/k/v in the engine's layout: [B, S, H, D] memory viewed as [B, H, S, D]
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=dtype).transpose(1, 2)
               for h in (Hq, Hk, Hk))
    do = torch.randn(B, S, Hq, D, generator=g, dtype=dtype).transpose(1, 2)  # as the layer's
    scale = D ** -0.5 * 1.3
    ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ins, is_causal=True, scale=scale, enable_gqa=Hq != Hk)
    ref_grads = torch.autograd.grad(ref, ins, do)
    got_in = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    got = attn_mod.SDPAFunction.apply(*got_in, scale, False)
    got_grads = torch.autograd.grad(got, got_in, do)
    assert got.shape == ref.shape and got.dtype == dtype
    for a, b in zip((got, *got_grads), (ref, *ref_grads)):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def test_dense_order_round_trip():
    t = torch.randn(2, 5, 3, 4).transpose(1, 2)  # [2, 3, 5, 4] with [2, 5, 3, 4] memory
    base, back = ckpt._dense_order(t)
    assert base.is_contiguous() and base.data_ptr() == t.data_ptr()
    assert torch.equal(base.permute(back), t) and base.permute(back).stride() == t.stride()
    c = torch.randn(3, 4)
    assert ckpt._dense_order(c) == (c, None)
    s = torch.randn(4, 6)[:, ::2]  # not a permutation of a dense tensor: copied
    base, back = ckpt._dense_order(s)
    assert back is None and base.is_contiguous() and torch.equal(base, s)


@pytest.fixture
def counters(monkeypatch):
    """Dense-weight fetches per base module (each base of a group fetch counts once, grouped
    dequant or not), and calls of the attention forward kernel."""
    seen, fwd = Counter(), [0]
    orig_w, orig_f = quant.dense_weights, attn_mod._fwd

    def counted_w(bases, dtype):
        for b in bases:
            seen[id(b)] += 1
        return orig_w(bases, dtype)

    def counted_f(*a, **kw):
        fwd[0] += 1
        return orig_f(*a, **kw)

    monkeypatch.setattr(quant, "dense_weights", counted_w)
    monkeypatch.setattr(attn_mod, "_fwd", counted_f)
    return seen, fwd


def _engine(base, checkpointing, nf4):
    pm = engine.prepare(copy.deepcopy(base), spec(), load_in_4bit=nf4, impl="reference",
                        device="cpu", checkpointing=checkpointing)
    randomise_lora(pm)
    pm.train()
    return pm


def _steps(pm, padded=False, n=2):
    opt = optim.make_optimizer(pm, "adamw_torch", lr=1e-2)
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 96, (2, 17), generator=g)
        mask = torch.ones_like(ids)
        if padded:
            mask[0, -4:] = 0
        loss = pm(input_ids=ids, attention_mask=mask,
                  labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        out.append((loss.item(), lora_grads(pm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _attn_bases(pm):
    return [[getattr(m, "base_layer", m) for m in (l.self_attn.q_proj, l.self_attn.k_proj,
                                                    l.self_attn.v_proj, l.self_attn.o_proj)]
            for l in pm.get_base_model().model.layers]


@pytest.mark.parametrize("arch,stash", [("llama", "qkvo"), ("qwen3", "qkvo"), ("gemma2", "qkvo"),
                                        ("llama", "o"), ("llama", "off")])
@pytest.mark.parametrize("nf4", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_recompute_reuses_attention(arch, stash, nf4, padded, counters, monkeypatch):
    """stash "qkvo" (default): no attention forward and no q/k/v/o base GEMM in the recompute;
    "o": q/k/v recomputed; "off": attention recomputed too. o_proj's skip holds in every mode."""
    monkeypatch.setattr(attn_mod, "STASH", stash)
    seen, fwd = counters
    base = tiny_model(arch)
    plain, ck = _engine(base, False, nf4), _engine(base, True, nf4)
    ref = _steps(plain, padded)
    seen.clear()
    fwd[0] = 0
    got = _steps(ck, padded)
    for (lr, gr), (lc, gc) in zip(ref, got):
        assert abs(lr - lc) <= 1e-6, (lr, lc)
        assert gr.keys() == gc.keys() and len(gr) > 0
        assert max((gr[k] - gc[k]).abs().max().item() for k in gr) <= 1e-6
    layers = len(_attn_bases(ck))
    fused = not padded and arch != "gemma2"  # Gemma 2: soft-capped (and windowed) attention
    # fused: one attention forward per layer and step, none in the recompute (unless "off")
    assert fwd[0] == ((4 if stash == "off" else 2) * layers if fused else 0)
    skip_qkv = fused and arch != "qwen3" and stash == "qkvo"  # qwen3's q/k norms need q, k
    qkv_fetches = 2 * (2 if skip_qkv else 3)
    o_fetches = 2 * (3 if arch == "gemma2" else 2)  # gemma2's post-attention norm reads o
    for q, k, v, o in _attn_bases(ck):
        assert [seen[id(m)] for m in (q, k, v)] == [qkv_fetches] * 3, arch
        assert seen[id(o)] == o_fetches, arch
    assert ckpt.stash_mode() == (None, None) and not ckpt.recomputing()


def test_stash_choice_follows_the_pcie_load():
    """Llama-3.1-8B shapes: 2048 x 2 would load PCIe ~98 % of the forward (off), 16384 x 1 ~78 %
    (stash); a tiny model's layer moves far more bytes than it computes (off)."""
    params = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    assert attn_mod.stash_choice(2, 2048, 4096, 4096, 1024, params) == "off"
    assert attn_mod.stash_choice(1, 16384, 4096, 4096, 1024, params) == "qkvo"
    assert attn_mod.stash_choice(2, 17, 64, 64, 32, 64 * 96 * 3 + 64 * 64 * 3) == "off"


def test_auto_stash_follows_stash_choice(monkeypatch, counters):
    """STASH "auto": a layer stashes what stash_choice says for its shapes."""
    seen, fwd = counters
    monkeypatch.setattr(attn_mod, "STASH", "auto")
    monkeypatch.setattr(attn_mod, "STASH_MAX_LOAD", 1e9)  # the tiny layer then counts as cheap
    base = tiny_model("llama")
    ck = _engine(base, True, False)
    _steps(ck, n=1)
    assert fwd[0] == len(_attn_bases(ck))  # no attention forward in the recompute
    monkeypatch.setattr(attn_mod, "STASH_MAX_LOAD", 0.85)
    fwd[0] = 0
    _steps(ck, n=1)
    assert fwd[0] == 2 * len(_attn_bases(ck))  # the real threshold: recomputed


def test_stash_is_taken_once_and_keeps_order():
    off = ckpt.Offloader(enabled=False)
    st = ckpt.Stash(off, (0, 0))
    assert not st.pending()
    a, b, lse = torch.randn(2, 3), torch.randn(4), torch.randn(5)
    st.put(a, b, keep=(lse,))
    assert st.pending()
    got = st.take()
    assert [t is x for t, x in zip(got, (a, b, lse))] == [True, True, True]
    assert not st.pending() and st.take() == []
