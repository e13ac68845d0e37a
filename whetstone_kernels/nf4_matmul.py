"""Fused NF4 matmul for decoding: y = x @ dequant(W)^T (+ bias) without materialising W.

For a frozen bitsandbytes NF4 weight W [N, K] (blocksize a power of two >= 32 dividing K, absmax
plain fp32 or double-quantised) and a few rows of activations x [M, K] (decode with a KV cache:
M = batch, typically 1..64), each program walks a BLOCK_N-row strip of W through K in pieces of
PIECE = min(blocksize, BLOCK_K) elements, one absmax per row and piece:

    absmax[j] = fl(fl(code2[qabsmax[j]] * absmax2[j // blocksize2]) + offset)   (nested; else fp32 absmax[j])
    part[n, m] = sum_j code[byte[n, j] >> 4] * x[m, kp + 2j] + code[byte[n, j] & 15] * x[m, kp + 2j + 1]
    acc[n, m] += absmax[n, piece] * part[n, m]

so the absmax multiplies a [BLOCK_N, BLOCK_M] partial once per piece instead of every weight, and
the high and low nibbles meet the even and odd columns of x in two tensor-core dots (no interleave
of the dequantised values back into k order). ``code`` is the 16-entry NF4 table in x's dtype; with
one row (BLOCK_M = 1) the table is fp32 and the dots are CUDA-core FMAs into a [BLOCK_N, PIECE/2]
accumulator reduced once at the end. Numerics: W[n, k] enters as code (rounded to x's dtype; exact
in fp32) times the fp32 absmax, accumulated in fp32; dequantise + GEMM (``impl="reference"``)
rounds code * absmax to x's dtype first. The two differ at the rounding level of x's dtype.

Grid: (ceil(N / BLOCK_N), SPLIT_K, ceil(M / BLOCK_M)), SPLIT_K a runtime argument; M is padded to
BLOCK_M = 1/16/32/64 (masked).
With SPLIT_K > 1 every program writes its fp32 partial [M, BLOCK_N] to a workspace and increments a
per-tile counter (acq_rel atomic); the program that arrives last sums the SPLIT_K partials in fixed
order (deterministic: the same result every call), adds the bias, casts, stores y and resets the
counter to 0. One launch per call, no memset. The counters are a cached per-device int32 buffer,
so calls on one device must be ordered on one stream (two concurrent streams would share counters).

Shapes / dtypes: x [..., K] fp32/fp16/bf16 (flattened to M rows), packed uint8 (N*K/2 bytes, any
shape, bitsandbytes' [N*K/2, 1]), state an ``NF4State`` or bitsandbytes ``QuantState`` with
shape (N, K); bias [N] or None; y [..., N] in x's dtype (``impl="reference"`` = x @
nf4_dequantize_ref(W, x.dtype)^T); fp32 dots use IEEE fp32 (no TF32). K % blocksize != 0 raises ValueError. Forward only: calling it
with grad mode on and x (or bias) requiring grad raises RuntimeError (use ``whetstone_kernels.nf4.nf4_linear``).

Traffic: N*K/2 bytes of NF4 (+ N*K/blocksize absmax bytes, + M*K*itemsize of x per N tile, in L2)
instead of dequant (N*K/2 read + N*K*2 written) then a GEMM reading N*K*2: for Llama-3.1-8B's 224
linear weights, 3.5 GB a decode step, about 0.85 ms at the H200's 4.2 TB/s. For prefill (M in the
hundreds) dequant + a tensor-core GEMM (``nf4_linear``) is the better choice.

Source: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (NF4, double
quantisation); bitsandbytes' ``quantize_4bit`` format (see whetstone_kernels/nf4_ref.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_impl, num_sms
from .launch import launch
from .nf4 import _as_state, _code, block_absmax
from .nf4_ref import nf4_dequantize_ref

_LOCKS: dict = {}  # device -> int32 counters, all zero between calls


@triton.jit
def _nf4_matmul_kernel(X, Q, ABSMAX, ABSMAX2, CODE2, OFFSET, CODE, BIAS, Y, PART, LOCKS,
                       M, N, K, KH, k_per_split, split_k, stride_xm, stride_ym,
                       BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIECE: tl.constexpr, IEEE: tl.constexpr):
    # BLOCK_K divides K and PIECE (one absmax block, or part of one) divides BLOCK_K: no K masks
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    HP: tl.constexpr = PIECE // 2      # packed bytes of a row in one piece
    NP: tl.constexpr = BLOCK_K // PIECE
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    jj = tl.arange(0, HP)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    q_tile = Q + offs_n[:, None] * KH + jj[None, :]  # [BLOCK_N, HP]: byte j of a piece = elements 2j, 2j+1
    blk_row = offs_n * (K // BLOCKSIZE)
    x_even = X + offs_m[None, :] * stride_xm + 2 * jj[:, None]  # [HP, BLOCK_M]: x[m, 2j]
    if BLOCK_M == 1:
        acc1 = tl.zeros([BLOCK_N, HP], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)
        for p in tl.static_range(NP):
            kp = k0 + p * PIECE
            b = tl.load(q_tile + kp // 2, mask=n_ok[:, None], other=0).to(tl.int32)
            amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk_row + kp // BLOCKSIZE, n_ok,
                                BLOCKSIZE2, NESTED)  # [BLOCK_N] fp32, one per row for the whole piece
            hi = tl.load(CODE + (b >> 4))  # code[q] of element kp + 2j (high nibble), table dtype
            lo = tl.load(CODE + (b & 15))  # element kp + 2j + 1
            xe = tl.load(x_even + kp, mask=m_ok[None, :], other=0.0)
            xo = tl.load(x_even + kp + 1, mask=m_ok[None, :], other=0.0)
            if BLOCK_M == 1:  # one row: CUDA-core FMAs, reduced across the tile once at the end
                acc1 += (hi * tl.trans(xe).to(tl.float32) + lo * tl.trans(xo).to(tl.float32)) * amax[:, None]
            else:  # sum_j code[q] x over the piece on tensor cores, then scaled by the piece's absmax
                if IEEE:
                    part = tl.dot(hi, xe, input_precision="ieee")
                    part = tl.dot(lo, xo, part, input_precision="ieee")
                else:
                    part = tl.dot(hi, xe)
                    part = tl.dot(lo, xo, part)
                acc += part * amax[:, None]
    if BLOCK_M == 1:
        acc = tl.sum(acc1, axis=1)[:, None]
    y_ptr = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
    y_ok = n_ok[:, None] & m_ok[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=y_ok)
    else:
        part = PART + offs_m[None, :] * N + offs_n[:, None]
        tl.store(part + pid_k * M * N, acc, mask=y_ok)
        tl.debug_barrier()  # every thread's partial is written before the release below
        lock = LOCKS + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel") == split_k - 1:  # the last program of this tile reduces
            tot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(split_k):
                tot += tl.load(part + s * M * N, mask=y_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr, tot.to(Y.dtype.element_ty), mask=y_ok)
            tl.atomic_xchg(lock, 0)


def _locks(device, n: int) -> torch.Tensor:
    buf = _LOCKS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = buf
    return buf


def pick_config(M: int, N: int, K: int, blocksize: int, device) -> dict:
    """Tile sizes and split-K by shape (no autotuning: the first call compiles one kernel per shape class).

    BLOCK_M: 1 for one row (CUDA-core FMAs), else M padded to 16/32/64 (tensor cores). BLOCK_N x
    BLOCK_K: the tile of W per loop step (the launcher halves BLOCK_K until it divides K). SPLIT_K:
    doubled while there are fewer than 4 programs per SM and every split keeps >= 2 K chunks (a
    1024 x 4096 weight has only 16 N tiles)."""
    block_m = 1 if M == 1 else 16 if M <= 16 else 32 if M <= 32 else 64
    if INTERPRET or device.type != "cuda":
        block_n, block_k, warps, stages = 32, 64, 4, 1
    else:
        block_n, block_k, warps, stages = 64, 128, 4, 1
    tiles = -(-N // block_n) * -(-M // block_m)
    chunks = -(-K // block_k)
    target = 4 * num_sms(device)
    split = 1
    while tiles * split < target and chunks // (split * 2) >= 2 and split < 16:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
                num_stages=stages)


_TABLES: dict = {}


def _table(device, dtype) -> torch.Tensor:
    """The 16 NF4 code values in ``dtype`` (cached per device and dtype)."""
    key = (str(device), dtype)
    if key not in _TABLES:
        _TABLES[key] = _code(device).to(dtype)
    return _TABLES[key]


def nf4_matmul_fwd(x: torch.Tensor, packed: torch.Tensor, state, bias: torch.Tensor | None = None,
                   config: dict | None = None) -> torch.Tensor:
    """The Triton launcher: x [M, K] (rows contiguous) -> y [M, N]; ``config`` overrides pick_config."""
    st = _as_state(state)
    N, K = int(st.shape[0]), int(st.shape[1])
    M = x.shape[0]
    bs = st.blocksize
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))
    cfg = dict(config or pick_config(M, N, K, bs, x.device))
    block_k, split = cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    if block_k < 32 or block_k & (block_k - 1):
        raise ValueError(f"BLOCK_K must be a power of two >= 32, got {block_k}")
    while K % block_k:  # K is a multiple of blocksize (a power of two >= 32): this ends there or above
        block_k //= 2
    chunks = -(-K // block_k)
    split = max(1, min(split, chunks))
    k_per_split = -(-chunks // split) * block_k
    split = -(-K // k_per_split)  # no empty splits
    grid = (-(-N // block_n), split, -(-M // block_m))
    nested = st.nested
    absmax = st.absmax
    offset = (st.offset if st.offset.dtype == torch.float32 else st.offset.float()) if nested else absmax
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else y
    locks = _locks(x.device, grid[0] * grid[2]) if split > 1 else y
    launch(_nf4_matmul_kernel, grid,
           x, packed, absmax, st.absmax2 if nested else absmax, st.code2 if nested else absmax, offset,
           _table(x.device, torch.float32 if block_m == 1 else x.dtype), bias if bias is not None else y, y, part, locks,
           M, N, K, K // 2, k_per_split, split, x.stride(0), y.stride(0),
           BLOCKSIZE=bs, BLOCKSIZE2=st.blocksize2 if nested else 1, NESTED=nested, HAS_BIAS=bias is not None,
           SPLIT=split > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PIECE=min(bs, block_k),
           IEEE=x.dtype == torch.float32, **cfg)
    return y


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, state, bias: torch.Tensor | None = None,
               impl: str = "triton", config: dict | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for decoding, W [N, K] NF4 (bitsandbytes); x [..., K] -> y [..., N].

    impl "triton": the fused kernel (never materialises W); "reference": x @ nf4_dequantize_ref(W)^T.
    Forward only (no autograd)."""
    check_impl(impl)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        raise RuntimeError("nf4_matmul is forward-only (decode under torch.no_grad()); x requires grad: "
                           "use whetstone_kernels.nf4.nf4_linear for a differentiable NF4 linear")
    st = _as_state(state)
    if len(st.shape) != 2:
        raise ValueError(f"NF4 weight must be 2-D [N, K], got shape {tuple(st.shape)}")
    N, K = int(st.shape[0]), int(st.shape[1])
    if K % st.blocksize:
        raise ValueError(f"nf4_matmul needs K % blocksize == 0: weight shape {tuple(st.shape)} (K={K}), "
                         f"blocksize {st.blocksize}")
    if x.shape[-1] != K:
        raise ValueError(f"x has last dim {x.shape[-1]}, weight shape {tuple(st.shape)} needs K={K}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32/fp16/bf16, got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if impl == "reference":
        y = x @ nf4_dequantize_ref(packed, st, x.dtype).t()
        return y + bias if bias is not None else y
    bs = st.blocksize
    if bs < 32 or bs & (bs - 1):
        raise ValueError(f"nf4_matmul needs a power-of-two blocksize >= 32, got {bs}")
    if packed.numel() * 2 != N * K:
        raise ValueError(f"packed has {packed.numel()} bytes, weight shape {tuple(st.shape)} needs {N * K // 2}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = nf4_matmul_fwd(x2, packed, st, bias.contiguous() if bias is not None else None, config)
    return y.view(*lead, N)
