"""Attention of the fused layers: masks, and causal SDPA with a hand-held backward.

:func:`attention` takes q [B, Hq, S, D], k/v [B, Hk, S, D] (Hq a multiple of Hk: GQA) and returns
[B, S, Hq*D] in q's dtype. Plain causal attention without soft-capping runs through
:class:`SDPAFunction`, which calls the fused attention kernel itself (cuDNN's flash attention on
CUDA, ATen's flash kernel on the CPU: the ones ``F.scaled_dot_product_attention`` picks) and keeps
the output O and the logsumexp L [B, Hq, S] (fp32) for its backward, which calls the matching fused
backward (dQ, dK, dV from dO, Q, K, V, O, L; FlashAttention-2, Dao 2023, section 3.1.2).

Because O and L are all the backward needs, a checkpointed layer need not run attention again in its
recompute (:mod:`~worker.engine.checkpointing`, "stash"): while the checkpointed forward runs,
:class:`SDPAFunction` hands O and L (and Q, K, V, unless the layer has q/k norms) to the segment's
stash, which offloads them like the segment input; in the recompute it returns the stashed O
instead of computing it, and its backward uses the stashed tensors. The result is bit for bit the
recomputed one (the forward kernel is deterministic), without the attention forward (about a third
of attention time) and, with Q, K, V stashed, without the q/k/v projections either. What is
stashed follows ``STASH`` (env ``WHETSTONE_ATTN_STASH``): by default :func:`stash_choice` per
layer shape, since the offload competes for PCIe with the segment inputs' own copies.

Packed sequences (position_ids restart, no padding, no window) on CUDA run through
FlashAttention-2's variable-length kernel (:mod:`~worker.engine.varlen`: ``mask`` is then a
:class:`~worker.engine.varlen.Segments`, no [S, S] mask is made). Other masked attention (padding,
sliding windows, packed rows elsewhere) runs
through ``F.scaled_dot_product_attention`` with a boolean mask from :func:`build_mask`, and
Gemma 2's soft-capped attention as an explicit softmax; both are recomputed as before.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from worker.engine import checkpointing as ckpt
from worker.engine import varlen

_CUDNN_OK = [True]  # set False after the cuDNN op raises once; then F.sdpa (recomputed) is used
# what a checkpointed attention segment stashes: "auto" (default: :func:`stash_choice`), "qkvo",
# "o" (O and L only: q/k/v are recomputed) or "off" (attention recomputed as well)
STASH = os.environ.get("WHETSTONE_ATTN_STASH", "auto")
PCIE_BYTES_S = 50e9  # pinned host <-> device, one direction (H200 host: 54 GB/s measured, s4-c1)
GEMM_FLOPS_S = 600e12  # bf16 matmul rate the layer's GEMMs reach (H200: 600-800, s4-c1)
STASH_MAX_LOAD = 0.85  # the stash is used while the offload takes under this share of forward time


def stash_choice(B: int, S: int, hidden: int, q_dim: int, kv_dim: int, params: int) -> str:
    """"qkvo" when a checkpointed layer's offloaded saves with Q, K, V, O stashed (its two segment
    inputs [B, S, hidden] and Q, K, V, O, bf16) cross PCIe in under ``STASH_MAX_LOAD`` of the
    layer's forward time (linear FLOPs 2 B S params plus causal attention 2 B S^2 q_dim), else
    "off". The D2H copies run beside the forward; near saturation they stalled it: Llama-8B at
    2048 x 2 (load 0.98) ran noisier and no faster with the stash (s4-c5, s4-c6), at 16384 x 1
    (load 0.78) the stash gave 1.60 s a step against Unsloth's 1.95 s (s4-c4)."""
    T = B * S
    nbytes = 2 * T * (2 * hidden + 2 * q_dim + 2 * kv_dim)
    flops = 2 * T * params + 2 * B * S * S * q_dim
    load = (nbytes / PCIE_BYTES_S) / (flops / GEMM_FLOPS_S)
    return "qkvo" if load < STASH_MAX_LOAD else "off"


def mask_kind(position_ids, attention_mask, S) -> tuple[bool, bool]:
    """(packed, padded): position_ids [B, S] restart somewhere (padding-free packing), and
    attention_mask [B, S] has a 0. Each reads a value back from the device (a sync): call once per
    forward, and not at all for position_ids the caller made with arange (pass None)."""
    packed = position_ids is not None and S > 1 and bool(
        (position_ids[:, 1:] <= position_ids[:, :-1]).any())
    padded = attention_mask is not None and not bool(attention_mask.all())
    return packed, padded


def build_mask(position_ids, attention_mask, S, window, device, kind=None):
    """Boolean [B, 1, S, S] (True = attend) or None when plain causal attention is exact.

    Segments start where position_ids do not increase (padding-free packing); keys with
    attention_mask 0 are masked; window w keeps keys with q - k < w. Each query keeps itself, so a
    fully padded row never yields NaN (its outputs carry no loss). ``kind``: :func:`mask_kind`'s
    answer when the caller has it.
    """
    packed, padded = kind if kind is not None else mask_kind(position_ids, attention_mask, S)
    windowed = window is not None and S > window
    if not (packed or padded or windowed):
        return None
    i = torch.arange(S, device=device)
    m = (i[:, None] >= i[None, :])[None]
    if packed:
        start = torch.ones_like(position_ids, dtype=torch.bool)
        start[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
        seg = start.long().cumsum(-1)
        m = m & (seg[:, :, None] == seg[:, None, :])
    if padded:
        m = m & attention_mask[:, None, :].bool()
    if windowed:
        m = m & ((i[:, None] - i[None, :]) < window)[None]
    m = m | torch.eye(S, dtype=torch.bool, device=device)[None]
    return m[:, None]


def _fwd(q, k, v, scale):
    """(O [B, Hq, S, D], L [B, Hq, S] fp32, aux for the backward)."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale)
        return r[0], r[1], (r[6], r[7], r[2], r[3], r[4], r[5])
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True,
                                                                         scale=scale)
    return o, lse, ()


def _bwd(do, q, k, v, o, lse, aux, scale):
    # dO laid out like O, as autograd hands it to SDPA's own backward (for the layers' output,
    # o.transpose(1, 2).reshape(), it already is). torch 2.11's cuDNN backward caches its plan per
    # shape without dO's strides: in one process, a dO laid out differently from the first one seen
    # for that shape gives wrong dQ/dK/dV (rel. error ~1.4; device checks s4-c3, s4-c4). Keeping
    # dO like O keeps this function on the same plan as F.scaled_dot_product_attention's autograd.
    if do.stride() != o.stride():
        do = torch.empty_like(o).copy_(do)
    if q.is_cuda:
        seed, offset, cq, ck, mq, mk = aux
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, True, scale=scale)


class SDPAFunction(torch.autograd.Function):
    """Causal attention, forward(q, k, v, scale, stash_qkv, stash_policy) -> O [B, Hq, S, D].

    In a checkpointed segment's forward (``ckpt.stash_mode() == "record"``) O, L and, with
    ``stash_qkv``, Q, K, V go to the stash; in its recompute (``"replay"``) they come back from it
    and nothing is computed (with ``stash_qkv`` the q, k, v given may be uninitialised: only their
    graph is used). Saved for backward: Q, K, V, O, L and the kernel's rng/sequence tensors.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, stash_qkv, stash_policy="qkvo"):
        mode, stash = ckpt.stash_mode()
        if mode == "replay" and stash.pending():
            got = stash.take()
            if stash.qkv:
                q, k, v, o, lse, *aux = got
            else:
                o, lse, *aux = got
        else:
            o, lse, aux = _fwd(q, k, v, scale)
            policy = stash_policy if STASH == "auto" else STASH
            if mode == "record" and policy != "off":
                stash.qkv = stash_qkv and policy == "qkvo"
                stash.put(*((q, k, v) if stash.qkv else ()), o, keep=(lse, *aux))
        ctx.scale, ctx.aux = scale, tuple(aux)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _bwd(do, q, k, v, o, lse, ctx.aux, ctx.scale)
        return dq, dk, dv, None, None, None


def fused_ok(q, mask, softcap) -> bool:
    """True when :class:`SDPAFunction` runs this attention (plain causal, no soft-cap; on CUDA
    fp16/bf16, more than one position, while cuDNN works; any float dtype on the CPU)."""
    if mask is not None or softcap is not None:
        return False
    if q.is_cuda:  # cuDNN: fp16/bf16, and it refuses s_q = s_kv = 1
        return _CUDNN_OK[0] and q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] > 1
    return q.dtype in (torch.float32, torch.float64, torch.bfloat16)


def attention(q, k, v, mask, scaling, softcap, stash_qkv=False, stash_policy="qkvo"):
    """q [B, Hq, S, D], k/v [B, Hk, S, D] -> [B, S, Hq*D] (see the module docstring).

    ``stash_qkv``: in a checkpointed segment, Q, K, V are stashed with O (the caller may then feed
    uninitialised q, k, v in the recompute); ignored when :func:`fused_ok` is false.
    ``stash_policy``: what is stashed when ``STASH`` is "auto" (the layer's :func:`stash_choice`).
    """
    B, Hq, S, D = q.shape
    groups = Hq // k.shape[1]
    if isinstance(mask, varlen.Segments):  # packed rows (padding-free): FlashAttention varlen
        if varlen.usable(q, softcap, None):
            try:
                return varlen.varlen_attention(q, k, v, mask, scaling)
            except RuntimeError:
                varlen._WORKS[0] = False  # no flash varlen here: dense masks from now on
        mask = varlen.dense_mask(mask, B, S)
    mode, stash = ckpt.stash_mode()
    replay = mode == "replay" and stash.pending()
    if replay or fused_ok(q, mask, softcap):
        try:
            o = SDPAFunction.apply(q, k, v, scaling, stash_qkv, stash_policy)
            return o.transpose(1, 2).reshape(B, S, Hq * D)
        except RuntimeError:
            if replay or not q.is_cuda:
                raise
            _CUDNN_OK[0] = False  # no cuDNN attention on this GPU / build: F.sdpa from now on
    if softcap is not None:
        if groups > 1:
            k = k.repeat_interleave(groups, 1)
            v = v.repeat_interleave(groups, 1)
        s = (q @ k.transpose(-1, -2)) * scaling
        s = torch.tanh(s / softcap) * softcap
        if mask is None:
            i = torch.arange(S, device=q.device)
            mask = (i[:, None] >= i[None, :])[None, None]
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        o = p @ v
    elif mask is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                           enable_gqa=groups > 1)
    else:
        if groups > 1:  # the masked (memory-efficient) backend wants equal head counts
            k = k.repeat_interleave(groups, 1)
            v = v.repeat_interleave(groups, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return o.transpose(1, 2).reshape(B, S, Hq * D)
