"""Rotary position embedding (HF rotate-half layout) on q and k in one Triton launch, forward and backward.

Maths (per token, per head; R = rotary size <= head size D, H = R/2; fp32 arithmetic, one rounding):

    forward:  y[:H] = x[:H] cos - x[H:R] sin;   y[H:R] = x[H:R] cos + x[:H] sin;   y[R:] = x[R:]
    backward: the same kernel with sin -> -sin (rotation by -theta); nothing is saved but cos and sin.

One program per (batch, position) token loads cos/sin once and rotates every q head and every k head.
Inputs: q [B, Hq, S, D], k [B, Hk, S, D] with any strides except a unit last-dim stride (HF's transposed
[B, S, H, D] views work as-is); cos, sin [B or 1, S, R] (HF tables, halves equal; only the first half is
read). Dtypes fp32/fp16/bf16 (q, k and the tables may differ). Outputs keep q's/k's strides; with
``inplace=True`` the launcher writes over q and k (safe when nothing else needs them; the autograd
Function below stays out of place). Position ids, offsets, packed sequences whose positions restart,
partial rotary, and Llama-3 / YaRN frequencies are all expressed through cos/sin: see whetstone_kernels/rope_ref.py
(``rope_inv_freq``, ``rope_cos_sin``, ``packed_position_ids``). Source: Su et al. 2021 (RoFormer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_impl, next_pow2
from .launch import launch
from .rope_ref import rope_ref


@triton.jit
def _rotate_heads(X, Y, x_off, y_off, sxh, syh, nh, c, s, HALF, ROT, D,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr, COPY_PASS: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    m = (h < nh) & (d < HALF)
    xp = X + x_off + h * sxh + d
    yp = Y + y_off + h * syh + d
    x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(yp, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=m)
    tl.store(yp + HALF, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=m)
    if COPY_PASS:
        p = tl.arange(0, BLOCK_P)[None, :]
        mp = (h < nh) & (p < D - ROT)
        v = tl.load(X + x_off + h * sxh + ROT + p, mask=mp, other=0.0)
        tl.store(Y + y_off + h * syh + ROT + p, v.to(Y.dtype.element_ty), mask=mp)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, S, HQ, HK,
                 sqb, sqh, sqs, skb, skh, sks, sob, soh, sos, skob, skoh, skos, scb, scs,
                 HALF, ROT, D, SIGN: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_P: tl.constexpr, COPY_PASS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    t = pid % S
    dd = tl.arange(0, BLOCK_HALF)[None, :]
    cm = dd < HALF
    c = tl.load(COS + b * scb + t * scs + dd, mask=cm, other=0.0).to(tl.float32)
    s = tl.load(SIN + b * scb + t * scs + dd, mask=cm, other=0.0).to(tl.float32) * SIGN
    _rotate_heads(Q, QO, b * sqb + t * sqs, b * sob + t * sos, sqh, soh, HQ, c, s, HALF, ROT, D,
                  BLOCK_HQ, BLOCK_HALF, BLOCK_P, COPY_PASS)
    _rotate_heads(K, KO, b * skb + t * sks, b * skob + t * skos, skh, skoh, HK, c, s, HALF, ROT, D,
                  BLOCK_HK, BLOCK_HALF, BLOCK_P, COPY_PASS)


def _unit_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(q, k, cos, sin, qo, ko, sign):
    b, hq, s, d = q.shape
    hk = k.shape[1]
    rot = cos.shape[-1]
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d or rot > d or rot % 2:
        raise ValueError(f"bad shapes q {tuple(q.shape)} k {tuple(k.shape)} cos {tuple(cos.shape)}")
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if cos.shape != sin.shape or cos.shape[0] not in (1, b) or cos.shape[1] != s:
        raise ValueError(f"cos/sin must be [B or 1, S, R], got {tuple(cos.shape)}")
    cos, sin = _unit_last(cos), _unit_last(sin)
    if sin.stride() != cos.stride():
        sin = sin.contiguous()
        cos = cos.contiguous()
    scb = cos.stride(0) if cos.shape[0] == b and b > 1 else 0
    copy_pass = rot < d and qo.data_ptr() != q.data_ptr()
    if b * s == 0:
        return
    launch(_rope_kernel, (b * s,),
           q, k, qo, ko, cos, sin, s, hq, hk,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2), scb, cos.stride(1),
           rot // 2, rot, d, SIGN=sign, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk),
           BLOCK_HALF=next_pow2(rot // 2), BLOCK_P=next_pow2(max(d - rot, 1)), COPY_PASS=copy_pass,
           num_warps=4 if next_pow2(hq) * next_pow2(rot // 2) <= 2048 else 8)


def rope_fwd(q, k, cos, sin, inplace: bool = False):
    """Rotate q and k by theta; returns (q_out, k_out). inplace=True writes over q and k."""
    q, k = _unit_last(q), _unit_last(k)
    qo, ko = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    _launch(q, k, cos, sin, qo, ko, 1.0)
    return qo, ko


def rope_bwd(dq_out, dk_out, cos, sin, inplace: bool = False):
    """Gradients w.r.t. q and k: the rotation by -theta applied to the output gradients."""
    dq_out, dk_out = _unit_last(dq_out), _unit_last(dk_out)
    dq, dk = (dq_out, dk_out) if inplace else (torch.empty_like(dq_out), torch.empty_like(dk_out))
    _launch(dq_out, dk_out, cos, sin, dq, dk, -1.0)
    return dq, dk


class RoPEFunction(torch.autograd.Function):
    """Autograd wrapper: saves only cos and sin (no activations)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.meta = (q.shape, q.dtype, k.shape, k.dtype)
        return rope_fwd(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dqo, dko):
        cos, sin = ctx.saved_tensors
        qs, qd, ks, kd = ctx.meta
        dqo = torch.zeros(qs, dtype=qd, device=cos.device) if dqo is None else dqo
        dko = torch.zeros(ks, dtype=kd, device=cos.device) if dko is None else dko
        dq, dk = rope_bwd(dqo, dko, cos, sin)
        return dq, dk, None, None


def rope(q, k, cos, sin, impl: str = "triton"):
    """Apply rotary embeddings to q [B,Hq,S,D] and k [B,Hk,S,D] with HF cos/sin [B or 1,S,R]."""
    check_impl(impl)
    if impl == "reference":
        return rope_ref(q, k, cos, sin)
    if not torch.is_grad_enabled():  # no autograd node to build
        return rope_fwd(q, k, cos, sin)
    return RoPEFunction.apply(q, k, cos, sin)
