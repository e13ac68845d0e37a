"""Attention over packed sequences without a dense mask: FlashAttention-2's variable-length kernel.

Padding-free batches (TRL's ``padding_free``, and ``packing``, whose BFD strategy implies it) put
several rows into one sequence and restart ``position_ids`` at each row. Attention must stay inside
each row. The dense route (:func:`worker.engine.attention.build_mask`) builds a boolean [B, 1, S, S]
mask and runs the memory-efficient SDPA kernel: O(S^2) mask memory, no flash kernel, and the
attention is recomputed in the checkpointed backward. Here the rows are described by their start
offsets instead, ``cu_seqlens`` (int32 [N + 1], N rows over the B*S flattened tokens), and
attention runs through ATen's FlashAttention-2 varlen kernels (``aten._flash_attention_forward`` /
``_flash_attention_backward`` with ``cum_seq_q``/``cum_seq_k``; Dao 2023, the kernels behind
``torch.nn.attention.varlen``), causal inside each row, GQA handled by the kernel (Hk divides Hq).

CUDA only, fp16/bf16, head_dim <= 256, no soft-capping and no sliding window (those keep the dense
mask). Env ``WHETSTONE_VARLEN=0`` turns it off (the dense mask is used everywhere).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENABLED = os.environ.get("WHETSTONE_VARLEN", "1") != "0"
_WORKS = [True]  # set False after the kernel raises once on this GPU / build: dense masks after


@dataclass(frozen=True)
class Segments:
    """Packed rows of a [B, S] batch: ``cu_seqlens`` int32 [N + 1] (start offsets into the B*S
    flattened tokens, last = B*S) and ``max_len`` (the longest row, tokens)."""

    cu_seqlens: torch.Tensor
    max_len: int


def segments(position_ids: torch.Tensor) -> Segments:
    """Rows of a padding-free batch from position_ids [B, S] (int): a row starts at each batch
    row's first token and wherever position_ids do not increase. One host sync (the longest row).
    """
    B, S = position_ids.shape
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
    idx = torch.nonzero(start.reshape(-1), as_tuple=True)[0]
    total = torch.tensor([B * S], dtype=idx.dtype, device=idx.device)
    cu = torch.cat([idx, total]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return Segments(cu, max_len)


def dense_mask(seg: Segments, B: int, S: int) -> torch.Tensor:
    """The same rows as :func:`worker.engine.attention.build_mask` writes them: bool [B, 1, S, S]
    (True = attend), causal within each row (the fallback when the kernel cannot run)."""
    T = B * S
    row = torch.zeros(T, dtype=torch.long, device=seg.cu_seqlens.device)
    row[seg.cu_seqlens[1:-1].long()] = 1
    row = row.cumsum(0).view(B, S)
    i = torch.arange(S, device=row.device)
    m = (i[:, None] >= i[None, :])[None] & (row[:, :, None] == row[:, None, :])
    return m[:, None]


def usable(q: torch.Tensor, softcap, window) -> bool:
    """True when :func:`varlen_attention` can run q [B, Hq, S, D] here (see the module docstring)."""
    return (ENABLED and _WORKS[0] and q.is_cuda and softcap is None and window is None
            and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0)


class VarlenFunction(torch.autograd.Function):
    """forward(q [T, Hq, D], k/v [T, Hk, D], cu_seqlens int32 [N + 1], max_len, scale) -> O
    [T, Hq, D], causal within each row. Saved for backward: Q, K, V, O, the logsumexp and the
    kernel's rng state; the backward is FlashAttention-2's (dQ, dK, dV)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse, cu, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            do.contiguous(), q, k, v, o, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True,
            rng, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def varlen_attention(q, k, v, seg: Segments, scale: float):
    """q [B, Hq, S, D], k/v [B, Hk, S, D] (the layers' layout) -> [B, S, Hq*D], attention causal
    within each row of ``seg``. Raises RuntimeError from the kernel (the caller falls back)."""
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    flat = lambda t, h: t.transpose(1, 2).reshape(B * S, h, D)  # noqa: E731 - [T, H, D] copies
    o = VarlenFunction.apply(flat(q, Hq), flat(k, Hk), flat(v, Hk), seg.cu_seqlens, seg.max_len,
                             scale)
    return o.reshape(B, S, Hq * D)
