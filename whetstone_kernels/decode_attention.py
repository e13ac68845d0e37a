"""Attention of one new token per row against a KV cache (decoding), in one pass over the keys.

For each row b and query head h (grouped-query: G = Hq / Hk query heads share key/value head
h // G), with n = col + 1 cache columns written so far:

    o[b, h] = sum_j softmax_j(scale * q[b, h] . k[b, h // G, j] | valid[b, j]) v[b, h // G, j],  j < n

Keys where ``valid`` is False (left padding) get no weight. Columns at or after n (not written yet)
are never read: ``col`` is a 1-element int64 device tensor, read by the kernel, so one captured
CUDA graph serves every token while the keys it reads grow with the text (a [B, Hk, 1, L] matmul
reads all L = P + T columns every token: 4.3 GB a token for 16 rows of Llama-3.1-8B at
1,024 + 1,024, where this reads on average the 3.2 GB written).

Each program takes one (row, key/value head) and one of SPLIT slices of the n columns, walks it in
BLOCK_L blocks with the online softmax of FlashAttention (running max m, sum l, fp32 accumulator;
Dao 2023, "FlashAttention-2", algorithm 1), the G query heads of the group padded to 16 rows of
one tensor-core dot per block. With SPLIT > 1 each slice writes its normalised output and
log-sum-exp and a second kernel merges the slices (flash-decoding: Dao et al. 2023,
"Flash-Decoding for long-context inference"), so a handful of rows still fills the GPU.

Shapes / dtypes: q [B, Hq, D], k/v caches [B, Hk, L, D] (any strides, last dim contiguous), fp16 /
bf16 / fp32 (fp32 dots in IEEE fp32); valid [B, L] bool; col int64 [1] with col < L; out [B, Hq, D]
in q's dtype. Scores, softmax and accumulation in fp32; the probabilities are rounded to v's dtype
for the second dot (as an eager softmax(...).to(v.dtype) @ v does). Raises ValueError on shape or
dtype mismatches. ``impl="reference"``: the same maths in PyTorch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_impl, next_pow2, num_sms
from .launch import launch


@triton.jit
def _decode_attn_kernel(Q, K, V, VALID, COL, O, PO, PL,
                        sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, s_valid, so_b, so_h,
                        Hk, scale,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                        BLOCK_L: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid // Hk
    hk = pid % Hk
    n = tl.load(COL).to(tl.int32) + 1
    per = tl.cdiv(tl.cdiv(n, SPLIT), BLOCK_L) * BLOCK_L
    lo = pid_s * per
    hi = tl.minimum(lo + per, n)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    g_ok = g < G
    d_ok = d < D
    h = hk * G + g
    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for start in range(lo, hi, BLOCK_L):
        offs = start + tl.arange(0, BLOCK_L)
        in_range = offs < hi
        kv_ok = in_range[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs[:, None] * sk_l + d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        ok = tl.load(VALID + b * s_valid + offs, mask=in_range, other=0).to(tl.int1)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep zeros
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs[:, None] * sv_l + d[None, :], mask=kv_ok, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT == 1:
        tl.store(O + b * so_b + h[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        # slice (b, h, pid_s): normalised output and log-sum-exp (-inf for an empty slice)
        row = (b * Hk * G + h) * SPLIT + pid_s
        tl.store(PO + row[:, None] * DP + d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(PL + row, lse, mask=g_ok)


@triton.jit
def _combine_kernel(PO, PL, O, Hq, so_b, so_h, D: tl.constexpr, DP: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)  # b * Hq + h
    b = pid // Hq
    h = pid % Hq
    s = tl.arange(0, SPLIT)
    d = tl.arange(0, DP)
    lse = tl.load(PL + pid * SPLIT + s)
    m = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
    po = tl.load(PO + (pid * SPLIT + s)[:, None] * DP + d[None, :])
    out = tl.sum(po * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * so_b + h * so_h + d, out.to(O.dtype.element_ty), mask=d < D)


def pick_split(B: int, Hk: int, L: int, block_l: int, device) -> int:
    """Slices of the keys per (row, kv head): doubled (power of two, at most 32) while there are
    fewer than 2 programs per SM and each slice keeps >= 4 blocks of the L cache columns."""
    split = 1
    target = 2 * num_sms(device)
    while B * Hk * split < target and L // (block_l * split * 2) >= 4 and split < 32:
        split *= 2
    return split


def _reference(q, k, v, valid, col, scale):
    n = int(col.reshape(-1)[0]) + 1
    B, Hq, D = q.shape
    Hk = k.shape[1]
    qg = q.reshape(B, Hk, Hq // Hk, D).float()
    s = (qg @ k[:, :, :n].float().transpose(-1, -2)) * scale
    s = s.masked_fill(~valid[:, None, None, :n], float("-inf"))
    p = torch.softmax(s, -1)
    return (p.to(v.dtype).float() @ v[:, :, :n].float()).reshape(B, Hq, D).to(q.dtype)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     col: torch.Tensor, scale: float, impl: str = "triton", split: int | None = None,
                     block_l: int = 64) -> torch.Tensor:
    """o [B, Hq, D] = softmax(scale q k^T | valid, columns <= col) v for one query per row (see module doc).

    q [B, Hq, D]; k, v [B, Hk, L, D] (Hq a multiple of Hk); valid [B, L] bool; col int64 [1] on
    q's device, the last written cache column (< L). ``split`` (a power of two) overrides
    :func:`pick_split`."""
    check_impl(impl)
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention needs q [B, Hq, D] and k, v [B, Hk, L, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, D = q.shape
    _, Hk, L, Dk = k.shape
    if k.shape[0] != B or Dk != D or Hq % Hk:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit k/v {tuple(k.shape)}")
    if tuple(valid.shape) != (B, L) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool [{B}, {L}], got {valid.dtype} {tuple(valid.shape)}")
    if q.dtype != k.dtype or v.dtype != k.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if impl == "reference":
        return _reference(q, k, v, valid, col, scale)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention needs the last dim of q, k and v contiguous")
    if split is not None and (split < 1 or split & (split - 1)):
        raise ValueError(f"split must be a power of two >= 1, got {split}")
    G = Hq // Hk
    DP = next_pow2(max(D, 16))
    split = split or pick_split(B, Hk, L, block_l, q.device)
    if valid.stride(1) != 1:
        valid = valid.contiguous()
    o = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if split > 1:
        po = torch.empty(B * Hq * split, DP, dtype=torch.float32, device=q.device)
        pl = torch.empty(B * Hq * split, dtype=torch.float32, device=q.device)
    else:
        po = pl = o
    valid_u8 = valid.view(torch.uint8)
    launch(_decode_attn_kernel, (B * Hk, split),
           q, k, v, valid_u8, col, o, po, pl,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           valid_u8.stride(0), o.stride(0), o.stride(1), Hk, float(scale),
           G=G, GP=max(16, next_pow2(G)), D=D, DP=DP, BLOCK_L=block_l, SPLIT=split,
           IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    if split > 1:
        launch(_combine_kernel, (B * Hq,), po, pl, o, Hq, o.stride(0), o.stride(1), D=D, DP=DP, SPLIT=split,
               num_warps=1)
    return o
