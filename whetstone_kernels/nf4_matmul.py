"""Fused NF4 matmul for decoding: y = x @ dequant(W)^T (+ bias) without materialising W.

For a frozen bitsandbytes NF4 weight W [N, K] (blocksize 64 or any power of two dividing K, absmax
plain fp32 or double-quantised) and a few rows of activations x [M, K] (decode with a KV cache:
M = batch, typically 1..64), each program reads the packed bytes of a BLOCK_N x BLOCK_K tile of W,
dequantises it in registers with the maths of ``whetstone_kernels/nf4.py`` (bit-identical W values):

    absmax[j] = fl(fl(code2[qabsmax[j]] * absmax2[j // blocksize2]) + offset)   (nested; else fp32 absmax[j])
    W[n, 2i]   = to_dtype(fl(NF4[byte[n, i] >> 4] * absmax[(n*K + 2i) // blocksize]))     (high nibble = even k)
    W[n, 2i+1] = to_dtype(fl(NF4[byte[n, i] & 15] * absmax[(n*K + 2i) // blocksize]))

and accumulates in fp32 with one ``tl.dot`` per BLOCK_K chunk: the chunk's bytes load as whole
vectors (the launcher picks BLOCK_K dividing K, so no K masks), the absmax of its BLOCK_K/blocksize
blocks broadcasts over each block's bytes, and the high/low nibble values are interleaved back into
k order in registers (tl.join):

    acc[n, m] += W[n, k0:k0+BLOCK_K] . x[m, k0:k0+BLOCK_K]

Grid: (ceil(N / BLOCK_N), SPLIT_K, ceil(M / BLOCK_M)), SPLIT_K a runtime argument; M is padded to
BLOCK_M = 16/32/64 (masked).
With SPLIT_K > 1 every program writes its fp32 partial [M, BLOCK_N] to a workspace and increments a
per-tile counter (acq_rel atomic); the program that arrives last sums the SPLIT_K partials in fixed
order (deterministic: the same result every call), adds the bias, casts, stores y and resets the
counter to 0. One launch per call, no memset. The counters are a cached per-device int32 buffer,
so calls on one device must be ordered on one stream (two concurrent streams would share counters).

Shapes / dtypes: x [..., K] fp32/fp16/bf16 (flattened to M rows), packed uint8 (N*K/2 bytes, any
shape, bitsandbytes' [N*K/2, 1]), state an ``NF4State`` or bitsandbytes ``QuantState`` with
shape (N, K); bias [N] or None; y [..., N] in x's dtype. W is dequantised to x's dtype (so
``impl="reference"`` = x @ nf4_dequantize_ref(W, x.dtype)^T differs only by accumulation order);
fp32 dots use IEEE fp32 (no TF32). K % blocksize != 0 raises ValueError. Forward only: calling it
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
def _nf4_matmul_kernel(X, Q, ABSMAX, ABSMAX2, CODE2, OFFSET, NF4, BIAS, Y, PART, LOCKS,
                       M, N, K, KH, k_per_split, split_k, stride_xm, stride_ym,
                       BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    # BLOCK_K divides K (the launcher picks it so), so no K masks: packed bytes load as whole vectors
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    BK2: tl.constexpr = BLOCK_K // 2  # packed bytes per row of a chunk
    SUB: tl.constexpr = BK2 // NB     # packed bytes per absmax block inside a chunk (NB blocks per chunk)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    nb = tl.arange(0, NB)
    jb = nb[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [NB, SUB]: byte offset inside the chunk
    kk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    q_rows = Q + offs_n[:, None, None] * KH  # [BLOCK_N, 1, 1]
    x_col = X + offs_m[None, :] * stride_xm
    blk_row = offs_n[:, None] * (K // BLOCKSIZE)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k0 = tl.multiple_of(k0, BLOCK_K)
        b = tl.load(q_rows + (k0 // 2 + jb)[None, :, :], mask=n_ok[:, None, None], other=0).to(tl.int32)
        amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk_row + k0 // BLOCKSIZE + nb[None, :],
                            n_ok[:, None], BLOCKSIZE2, NESTED)[:, :, None]  # [BLOCK_N, NB, 1]
        hi = tl.load(NF4 + (b >> 4)) * amax  # element k0 + 2j   [BLOCK_N, NB, SUB]
        lo = tl.load(NF4 + (b & 15)) * amax  # element k0 + 2j + 1
        xt = tl.load(x_col + (k0 + kk)[:, None], mask=m_ok[None, :], other=0.0)  # x[m, k0:k0+BLOCK_K]^T
        w = tl.reshape(tl.join(hi, lo), [BLOCK_N, BLOCK_K]).to(xt.dtype)  # W[n, k0 + (2j, 2j+1)]
        if IEEE:
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
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

    BLOCK_M: M padded to 16/32/64. BLOCK_N x BLOCK_K: the tile of W per loop step, dequantised in
    registers (the launcher halves BLOCK_K until it divides K). SPLIT_K: doubled while there are
    fewer than 4 programs per SM and every split keeps >= 2 K chunks (a 1024 x 4096 weight has only
    16 N tiles)."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    if INTERPRET or device.type != "cuda":
        block_n, block_k, warps, stages = 32, 64, 4, 1
    else:
        # H200 sweep (bench/nf4_matmul_bench.py --sweep, CUDA graphs, 2026-11-29): BLOCK_K 128 beat
        # 256/512 on all four Llama-3.1-8B shapes (6.27 vs 7.84 ms per token); pipelining did not help
        block_n, block_k, warps, stages = 64, 128, 4, 1
    tiles = -(-N // block_n) * -(-M // block_m)
    chunks = -(-K // block_k)
    target = 4 * num_sms(device)
    split = 1
    while tiles * split < target and chunks // (split * 2) >= 2 and split < 16:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
                num_stages=stages)


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
    if not INTERPRET:
        cfg["enable_fp_fusion"] = False  # absmax rounded twice, as bitsandbytes (bit-identical W)
    launch(_nf4_matmul_kernel, grid,
           x, packed, absmax, st.absmax2 if nested else absmax, st.code2 if nested else absmax, offset,
           _code(x.device), bias if bias is not None else y, y, part, locks,
           M, N, K, K // 2, k_per_split, split, x.stride(0), y.stride(0),
           BLOCKSIZE=bs, BLOCKSIZE2=st.blocksize2 if nested else 1, NESTED=nested, HAS_BIAS=bias is not None,
           SPLIT=split > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NB=max(block_k // bs, 1),
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
