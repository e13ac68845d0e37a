"""y = x @ A^T for few rows and a narrow A: the LoRA down-projection x A^T of a decode step, one launch.

A decode step of Llama-3.1-8B with a LoRA adapter on the 7 projections multiplies 16 rows x [16, 4096]
by A^T [4096, 48] (q, k, v stacked), [4096, 32] (gate, up), [4096, 16] (o) and [14336, 16] (down) in
every layer. cuBLAS runs each as a split-K GEMM plus a reduction kernel: 128 calls, ~1.0 ms of GPU
time a token at GRPO's 16 rows (bench/RESULTS.md, call s21-c4), for 40 MB of A. Here one launch does
one product: the grid is (R tiles, SPLIT_K, M tiles); each program multiplies x[M tile, its K range]
by A[R tile, its K range]^T on tensor cores (fp32 accumulation; IEEE fp32 for fp32 inputs), writes
its fp32 partial [BLOCK_M, BLOCK_R] to a workspace and increments a per-tile counter (acq_rel
atomic); the program that arrives last sums the SPLIT_K partials in fixed order (deterministic),
casts to x's dtype, stores y and resets the counter to 0 (no memset per call; the counters are a
cached per-device int32 buffer, so calls on one device must be ordered on one stream). With one
split the program stores y directly.

Shapes / dtypes: x [M, K] (unit column stride), A [R, K] (unit column stride), both fp32, fp16 or
bf16 and the same dtype; y [M, R] in x's dtype. ``impl="reference"`` = ``x @ A.t()``. Raises
ValueError on other shapes or dtypes. Forward only (decoding under ``torch.no_grad()``).

Source: the split-K "last program reduces" scheme of ``whetstone_kernels/nf4_matmul.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_impl, next_pow2, num_sms, tile_counters
from .launch import launch

_LOCKS: dict = {}  # device -> int32 counters, all zero between calls


@triton.jit
def _skinny_kernel(X, A, Y, PART, LOCKS, M, R, K, k_per_split, split_k, stride_xm, stride_ar, stride_ym,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    r_ok = offs_r < R
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptr = X + offs_m[:, None] * stride_xm + kk[None, :]
    a_ptr = A + offs_r[None, :] * stride_ar + kk[:, None]  # A^T tile [BLOCK_K, BLOCK_R]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + kk) < k_end
        xt = tl.load(x_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + k0, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, at, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, at, acc)
    y_ptr = Y + offs_m[:, None] * stride_ym + offs_r[None, :]
    y_ok = m_ok[:, None] & r_ok[None, :]
    if not SPLIT:
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=y_ok)
    else:
        part = PART + offs_m[:, None] * R + offs_r[None, :]
        tl.store(part + pid_k * M * R, acc, mask=y_ok)
        tl.debug_barrier()  # every thread's partial is written before the release below
        lock = LOCKS + pid_m * tl.num_programs(0) + pid_r
        if tl.atomic_add(lock, 1, sem="acq_rel") == split_k - 1:  # the last program of this tile reduces
            tot = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for s in range(split_k):
                tot += tl.load(part + s * M * R, mask=y_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr, tot.to(Y.dtype.element_ty), mask=y_ok)
            tl.atomic_xchg(lock, 0)


def pick_config(M: int, R: int, K: int, device) -> dict:
    """Tiles and split: BLOCK_M = M padded to 16/32/64, BLOCK_R = R padded to a power of two in
    [16, 64], BLOCK_K 128 (64 off the GPU); SPLIT_K doubled while the grid has fewer programs than
    SMs and each split keeps >= 2 K chunks (at most 64 splits)."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_r = min(64, max(16, next_pow2(R)))
    block_k = 128 if (device.type == "cuda" and not INTERPRET) else 64
    tiles = -(-M // block_m) * -(-R // block_r)
    chunks = -(-K // block_k)
    split = 1
    while tiles * split < num_sms(device) and chunks // (split * 2) >= 2 and split < 64:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=2)


def skinny_matmul(x: torch.Tensor, A: torch.Tensor, impl: str = "triton", config: dict | None = None) -> torch.Tensor:
    """y [M, R] = x [M, K] @ A [R, K]^T in x's dtype (fp32 accumulation), for few rows M (decode) and
    a narrow A (LoRA A matrices, stacked). ``config`` overrides :func:`pick_config`.
    Raises ValueError on shapes that do not chain or dtypes that differ or are not fp32/fp16/bf16."""
    check_impl(impl)
    if x.dim() != 2 or A.dim() != 2 or x.shape[1] != A.shape[1]:
        raise ValueError(f"skinny_matmul needs x [M, K] and A [R, K], got {tuple(x.shape)} and {tuple(A.shape)}")
    if x.dtype != A.dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x and A must share one of fp32/fp16/bf16, got {x.dtype} and {A.dtype}")
    if impl == "reference":
        return x @ A.t()
    M, K = x.shape
    R = A.shape[0]
    y = torch.empty(M, R, dtype=x.dtype, device=x.device)
    if M == 0 or R == 0:
        return y
    if K == 0:
        return y.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    A = A if A.stride(1) == 1 else A.contiguous()
    cfg = dict(config or pick_config(M, R, K, x.device))
    block_m, block_r, block_k, split = (cfg.pop(k) for k in ("BLOCK_M", "BLOCK_R", "BLOCK_K", "SPLIT_K"))
    chunks = -(-K // block_k)
    split = max(1, min(split, chunks))
    k_per_split = -(-chunks // split) * block_k
    split = -(-K // k_per_split)  # no empty splits
    grid = (-(-R // block_r), split, -(-M // block_m))
    part = torch.empty(split, M, R, dtype=torch.float32, device=x.device) if split > 1 else y
    locks = tile_counters(_LOCKS, x.device, grid[0] * grid[2], 1024) if split > 1 else y
    launch(_skinny_kernel, grid, x, A, y, part, locks, M, R, K, k_per_split, split,
           x.stride(0), A.stride(0), y.stride(0), SPLIT=split > 1, BLOCK_M=block_m, BLOCK_R=block_r,
           BLOCK_K=block_k, IEEE=x.dtype == torch.float32, **cfg)
    return y
