"""Fused NF4 matmul for decoding: y = x @ dequant(W)^T (+ bias) without materialising W.

For a frozen bitsandbytes NF4 weight W [N, K] (blocksize a power of two >= 32 dividing K, absmax
plain fp32 or double-quantised) and a few rows of activations x [M, K] (decode with a KV cache:
M = batch, typically 1..64), each program walks a BLOCK_N-row strip of W through K in chunks of
BLOCK_K, reading the packed bytes as whole vectors, with the maths of ``whetstone_kernels/nf4.py``:

    absmax[j] = fl(fl(code2[qabsmax[j]] * absmax2[j // blocksize2]) + offset)   (nested; else fp32 absmax[j])
    W[n, 2i]   = code[byte[n, i] >> 4] * absmax[(n*K + 2i) // blocksize]       (high nibble = even k)
    W[n, 2i+1] = code[byte[n, i] & 15] * absmax[(n*K + 2i) // blocksize]

Several rows (BLOCK_M = 16/32/64, M padded and masked), x fp16/bf16 (decoding): per absmax block,
the high nibbles' code values (elements 2i) and the low nibbles' (2i+1), looked up in x's dtype from a
table held in registers (``whetstone_kernels/nf4_lut.py``, PTX prmt), meet x's even and odd columns
in two tensor-core dots, and the block's fp32 absmax scales their sum:
acc[n, m] += absmax[n, blk] * (code[hi] . x[m, even] + code[lo] . x[m, odd]). W's values are thus
code rounded to x's dtype times an unrounded absmax (bitsandbytes rounds the product instead: the
same rounding level, not the same bits). Several fp32 rows: W's chunk is dequantised in registers
exactly as bitsandbytes does (bit-identical values; FMA contraction off), interleaved back into k
order (tl.join) and multiplied on tensor cores (IEEE fp32), acc[n, m] += W[n, chunk] . x[m, chunk].
One row (BLOCK_M = 1): per absmax block (or BLOCK_K piece of one), sum_i code[hi_i] x[2i] +
code[lo_i] x[2i+1] on CUDA-core FMAs in fp32, times the block's absmax, into a
[BLOCK_N, min(blocksize, BLOCK_K)/2] accumulator reduced once at the end: the same W values,
unrounded (the dequantised path rounds them to x's dtype first).

The LoRA term of an adapted projection, scale * (x A^T) B^T, is added in the epilogue when the
caller passes xa = x A^T and B (one [BLOCK_N, R] x [R, BLOCK_M] dot per tile, r masked to R: the next
power of two, at least 16; one row: a [BLOCK_N, R] product summed over R),
so decoding needs no separate B GEMM and add per projection.

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
nf4_dequantize_ref(W, x.dtype)^T, so several fp32 rows differ only by accumulation order); fp32 dots use
IEEE fp32 (no TF32). K % blocksize != 0 raises ValueError. Forward only: calling it
with grad mode on and x (or bias) requiring grad raises RuntimeError (use ``whetstone_kernels.nf4.nf4_linear``).

Traffic: N*K/2 bytes of NF4 (+ N*K/blocksize absmax bytes, + M*K*itemsize of x per N tile, in L2)
instead of dequant (N*K/2 read + N*K*2 written) then a GEMM reading N*K*2: for Llama-3.1-8B's 224
linear weights, 3.5 GB a decode step, about 0.85 ms at the H200's 4.2 TB/s. For prefill (M in the
hundreds) dequant + a tensor-core GEMM (``nf4_linear``) is the better choice.

Source: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (NF4, double
quantisation); bitsandbytes' ``quantize_4bit`` format (see whetstone_kernels/nf4_ref.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_impl, num_sms, tile_counters
from .launch import launch
from .nf4 import _as_state, _code, block_absmax
from .nf4_lut import code16, nf4_lookup
from .nf4_ref import nf4_dequantize_ref

_LOCKS: dict = {}  # device -> int32 counters, all zero between calls


@triton.jit
def _lora_term(XA, LB, offs_n, offs_m, n_ok, m_ok, r, stride_xa,
               R: tl.constexpr, BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
    """(x A^T) B^T for this tile: XA [M, r] (row stride ``stride_xa``), LB = B [N, r] contiguous;
    r <= R (a power of two >= 16, masked). fp32 [BLOCK_N, BLOCK_M]."""
    rr = tl.arange(0, R)
    r_ok = rr < r
    lb = tl.load(LB + offs_n[:, None] * r + rr[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    xat = tl.load(XA + offs_m[None, :] * stride_xa + rr[:, None], mask=r_ok[:, None] & m_ok[None, :], other=0.0)
    if BLOCK_M == 1:
        out = tl.sum(lb.to(tl.float32) * tl.trans(xat).to(tl.float32), axis=1)[:, None]
    elif IEEE:
        out = tl.dot(lb, xat, input_precision="ieee")
    else:
        out = tl.dot(lb, xat)
    return out


@triton.jit
def _nf4_matmul_kernel(X, Q, ABSMAX, ABSMAX2, CODE2, OFFSET, CODE, CODE16, BIAS, Y, PART, LOCKS, XA, LB,
                       M, N, K, KH, k_per_split, split_k, stride_xm, stride_ym, r, stride_xa, lora_scale,
                       BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr,
                       HAS_LORA: tl.constexpr, R: tl.constexpr, LUT: tl.constexpr, ASM: tl.constexpr):
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
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if BLOCK_M == 1:
        # one row: per absmax block, sum_j code[hi_j] x[2j] + code[lo_j] x[2j+1] on CUDA-core FMAs, times
        # the block's absmax, into a [BLOCK_N, SUB] accumulator reduced once at the end
        jj = tl.arange(0, SUB)
        q_tile = Q + offs_n[:, None] * KH + jj[None, :]
        x_even = X + pid_m * stride_xm + 2 * jj
        acc1 = tl.zeros([BLOCK_N, SUB], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k0 = tl.multiple_of(k0, BLOCK_K)
            for p in tl.static_range(NB):
                kp = k0 + p * 2 * SUB
                b = tl.load(q_tile + kp // 2, mask=n_ok[:, None], other=0).to(tl.int32)
                amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, offs_n * (K // BLOCKSIZE) + kp // BLOCKSIZE,
                                    n_ok, BLOCKSIZE2, NESTED)
                xe = tl.load(x_even + kp).to(tl.float32)
                xo = tl.load(x_even + kp + 1).to(tl.float32)
                acc1 += (tl.load(CODE + (b >> 4)) * xe[None, :] + tl.load(CODE + (b & 15)) * xo[None, :]) \
                    * amax[:, None]
        acc = tl.sum(acc1, axis=1)[:, None]
    elif LUT:
        # several rows, x fp16/bf16: per absmax block (or BLOCK_K piece of one), the high nibbles'
        # code values (elements 2j) dot x's even columns and the low nibbles' (2j+1) x's odd columns on
        # tensor cores, and the block's absmax scales that dot in fp32: no interleave, one table
        # lookup per nibble in registers (nf4_lut), no per-weight multiply
        q_lut = Q + offs_n[:, None] * KH + tl.arange(0, SUB)[None, :]
        x_rows = X + offs_m[:, None] * stride_xm + tl.arange(0, 2 * SUB)[None, :]
        blk_n = offs_n * (K // BLOCKSIZE)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k0 = tl.multiple_of(k0, BLOCK_K)
            for p in tl.static_range(NB):
                kp = k0 + p * 2 * SUB
                hi, lo = nf4_lookup(tl.load(q_lut + kp // 2, mask=n_ok[:, None], other=0), CODE16, ASM)
                xt = tl.load(x_rows + kp, mask=m_ok[:, None], other=0.0)  # x[m, kp:kp + 2 SUB]
                xe, xo = tl.split(tl.reshape(xt, [BLOCK_M, SUB, 2]))
                d = tl.dot(hi, tl.trans(xe))
                d = tl.dot(lo, tl.trans(xo), d)
                amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk_n + kp // BLOCKSIZE, n_ok,
                                    BLOCKSIZE2, NESTED)
                acc += d * amax[:, None]
    else:
        # several rows, fp32 x: the chunk's W dequantised exactly as bitsandbytes (interleaved back into k order)
        # and multiplied on tensor cores
        jb = nb[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [NB, SUB]: byte offset inside the chunk
        kk = tl.arange(0, BLOCK_K)
        q_rows = Q + offs_n[:, None, None] * KH  # [BLOCK_N, 1, 1]
        x_col = X + offs_m[None, :] * stride_xm
        blk_row = offs_n[:, None] * (K // BLOCKSIZE)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k0 = tl.multiple_of(k0, BLOCK_K)
            b = tl.load(q_rows + (k0 // 2 + jb)[None, :, :], mask=n_ok[:, None, None], other=0).to(tl.int32)
            amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk_row + k0 // BLOCKSIZE + nb[None, :],
                                n_ok[:, None], BLOCKSIZE2, NESTED)[:, :, None]  # [BLOCK_N, NB, 1]
            hi = tl.load(CODE + (b >> 4)) * amax  # element k0 + 2j   [BLOCK_N, NB, SUB]
            lo = tl.load(CODE + (b & 15)) * amax  # element k0 + 2j + 1
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
        if HAS_LORA:
            acc += lora_scale * _lora_term(XA, LB, offs_n, offs_m, n_ok, m_ok, r, stride_xa, R, BLOCK_M, IEEE)
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
            if HAS_LORA:
                tot += lora_scale * _lora_term(XA, LB, offs_n, offs_m, n_ok, m_ok, r, stride_xa, R, BLOCK_M, IEEE)
            tl.store(y_ptr, tot.to(Y.dtype.element_ty), mask=y_ok)
            tl.atomic_xchg(lock, 0)


def pick_config(M: int, N: int, K: int, blocksize: int, device, dtype: torch.dtype | None = None) -> dict:
    """Tile sizes and split-K by shape (no autotuning: the first call compiles one kernel per shape class).

    BLOCK_M: 1 for one fp32 row, or one row off the GPU (CUDA-core FMAs), else M padded to 16/32/64
    (tensor cores). BLOCK_N x
    BLOCK_K: the tile of W per loop step (the launcher halves BLOCK_K until it divides K). SPLIT_K:
    doubled while there are fewer than 4 programs per SM and every split keeps >= 2 K chunks (a
    1024 x 4096 weight has only 16 N tiles). ``dtype`` is x's (None: fp16/bf16, the decode case):
    several fp16/bf16 rows take the register-table path (nf4_lut), fp32 rows the exact one."""
    on_gpu = not INTERPRET and device.type == "cuda"
    half = dtype != torch.float32
    # one fp16/bf16 row on a GPU also takes the register-table tiles (padded to 16 rows): 4.77 ms per
    # Llama-3.1-8B token against 6.10 on the one-row FMA path (.gpu call s21-c2)
    block_m = 1 if M == 1 and not (half and on_gpu) else 16 if M <= 16 else 32 if M <= 32 else 64
    lut = block_m > 1 and half
    if not on_gpu:
        block_n, block_k, warps, stages = 32, 64, 4, 1
    elif lut:
        # H200 sweep of the register-table path (call s21-c1, M=16): BLOCK_N 128 (64 for a
        # narrow weight), BLOCK_K 128, 3 stages (the packed bytes are copied to shared memory ahead)
        block_n, block_k, warps, stages = 128 if N >= 4096 else 64, 128, 4, 3
    else:
        # H200 sweeps (bench/nf4_matmul_bench.py --sweep, CUDA graphs): fp32 rows, BLOCK_K 128
        # (s3-c2); one row, BLOCK_K 256 (s19-c1: 5.90 ms per Llama-3.1-8B token, 6.38 on tensor cores)
        block_n, block_k, warps, stages = 64, 256 if block_m == 1 else 128, 4, 1
    tiles = -(-N // block_n) * -(-M // block_m)
    chunks = -(-K // block_k)
    target = 4 * num_sms(device)
    split = 1
    while tiles * split < target and chunks // (split * 2) >= 2 and split < 16:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
                num_stages=stages)


def nf4_matmul_fwd(x: torch.Tensor, packed: torch.Tensor, state, bias: torch.Tensor | None = None,
                   config: dict | None = None, lora: tuple | None = None) -> torch.Tensor:
    """The Triton launcher: x [M, K] (rows contiguous) -> y [M, N]; ``config`` overrides pick_config;
    ``lora`` = (xa [M, r] with unit column stride, B [N, r] contiguous, scale) adds scale * xa B^T."""
    st = _as_state(state)
    N, K = int(st.shape[0]), int(st.shape[1])
    M = x.shape[0]
    bs = st.blocksize
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        y.zero_() if bias is None else y.copy_(bias.expand(M, N))
        if lora is not None:
            y.addmm_(lora[0], lora[1].t(), alpha=lora[2])
        return y
    cfg = dict(config or pick_config(M, N, K, bs, x.device, x.dtype))
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
    locks = tile_counters(_LOCKS, x.device, grid[0] * grid[2], 4096) if split > 1 else y
    xa, lb, scale = lora if lora is not None else (y, y, 0.0)
    r = xa.shape[1] if lora is not None else 0
    lut = block_m > 1 and x.dtype != torch.float32
    if not INTERPRET:
        # the fp32 tensor-core path dequantises exactly as bitsandbytes (absmax rounded twice: no FMA);
        # the one-row and register-table paths scale whole dots and want the FMAs
        cfg["enable_fp_fusion"] = block_m == 1 or lut
    launch(_nf4_matmul_kernel, grid,
           x, packed, absmax, st.absmax2 if nested else absmax, st.code2 if nested else absmax, offset,
           _code(x.device), code16(x.device, x.dtype) if lut else y, bias if bias is not None else y, y, part, locks, xa, lb,
           M, N, K, K // 2, k_per_split, split, x.stride(0), y.stride(0), r, xa.stride(0), float(scale),
           BLOCKSIZE=bs, BLOCKSIZE2=st.blocksize2 if nested else 1, NESTED=nested, HAS_BIAS=bias is not None,
           SPLIT=split > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NB=max(block_k // bs, 1),
           IEEE=x.dtype == torch.float32, HAS_LORA=lora is not None, R=max(16, triton.next_power_of_2(max(r, 1))),
           LUT=lut, ASM=not INTERPRET, **cfg)
    return y


def nf4_matmul(x: torch.Tensor, packed: torch.Tensor, state, bias: torch.Tensor | None = None,
               impl: str = "triton", config: dict | None = None, lora: tuple | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) (+ scale * xa @ B^T) for decoding, W [N, K] NF4 (bitsandbytes);
    x [..., K] -> y [..., N].

    ``lora`` = (xa, B, scale): a LoRA adapter's term added in the kernel's epilogue, xa = x A^T
    [rows, r] (rows = x's leading dims flattened; a column slice of a wider product is fine), B [N, r],
    both in x's dtype, scale a float; raises ValueError on other shapes or dtypes.
    impl "triton": the fused kernel (never materialises W); "reference": x @ nf4_dequantize_ref(W)^T
    (+ bias) (+ scale * xa @ B^T). Forward only (no autograd)."""
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
    if lora is not None:
        xa, lb, scale = lora
        rows = math.prod(x.shape[:-1])
        if xa.dim() != 2 or lb.dim() != 2 or xa.shape[0] != rows or lb.shape[0] != N or xa.shape[1] != lb.shape[1]:
            raise ValueError(f"lora needs xa [{rows}, r] and B [{N}, r], got {tuple(xa.shape)} and {tuple(lb.shape)}")
        if xa.dtype != x.dtype or lb.dtype != x.dtype:
            raise ValueError(f"lora xa and B must be in x's dtype {x.dtype}, got {xa.dtype} and {lb.dtype}")
    if impl == "reference":
        y = x @ nf4_dequantize_ref(packed, st, x.dtype).t()
        y = y + bias if bias is not None else y
        if lora is not None:
            y = y + lora[2] * (lora[0] @ lora[1].t()).view(y.shape)
        return y
    bs = st.blocksize
    if bs < 32 or bs & (bs - 1):
        raise ValueError(f"nf4_matmul needs a power-of-two blocksize >= 32, got {bs}")
    if packed.numel() * 2 != N * K:
        raise ValueError(f"packed has {packed.numel()} bytes, weight shape {tuple(st.shape)} needs {N * K // 2}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if lora is not None:
        xa, lb, scale = lora
        lora = (xa if xa.stride(1) == 1 else xa.contiguous(), lb.contiguous(), float(scale))
    y = nf4_matmul_fwd(x2, packed, st, bias.contiguous() if bias is not None else None, config, lora)
    return y.view(*lead, N)
