"""W' = dequant(W_nf4) + B A: an NF4 weight dequantised with its LoRA term merged in, in one pass.

A QLoRA projection computes Y = X W^T + s (X A^T) B^T. The engine dequantises W into a temporary
[N, K] for every pass anyway (forward, recompute, backward), so the rank-r term can be folded into
that temporary instead of into the output: with W' = W + (s B) A,

    Y  = X W'^T                  (one GEMM; no [T, N] LoRA output written and read back)
    dX = dY W'                   (one GEMM; no [T, K] dY B A written and read back)

while dA = s (dY B)^T X and dB = s dY^T (X A^T) are computed as before (they do not involve W).
The extra work sits in the dequantisation: per output tile [BN, BK] a tensor-core product
Bs[BN, r] A[r, BK] (fp32 accumulation), added to the fp32 dequantised values before the one rounding
to the output dtype. W' therefore differs from round(W) + round(s B A) only by where the rounding
happens (once, on the sum): within one ulp of the output dtype of the exact W + s B A.

Tiling: program (n, k) takes BN rows of W and NB quantisation blocks of each row (BK = NB *
blocksize columns); each quantisation block lies inside one row, so K must be a multiple of the
blocksize (true of every HF model: K is a multiple of 64). The absmax is dequantised once per block
(bitsandbytes' two roundings, fp-contraction off as in :mod:`whetstone_kernels.nf4`); the high / low
nibbles give the even / odd columns, whose LoRA terms are two dots against A's even / odd columns.

Shapes / dtypes: packed uint8 [ceil(N K / 2)] (bitsandbytes layout), A [r, K] and Bs [N, r] (s
already folded into Bs; unit column stride), both in the output dtype (fp32, fp16 or bf16); r <= 128.
``impl="reference"``: the same maths in torch (fp32 dequantisation + fp32 product, one rounding).
Raises ValueError on shapes that do not chain, a dtype mismatch, or K not a multiple of the
blocksize (use :func:`nf4_merged` 's caller-side fallback: dequantise, then ``addmm``).
Source: the merge W + s B A is PEFT's ``merge_adapter``; done per pass here, never stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_impl, next_pow2
from .launch import launch
from .nf4 import _as_state, _code, block_absmax
from .nf4_ref import nf4_dequantize_ref

# launch defaults (tile BN rows x NB quantisation blocks; 32 x 4 x 64 = 8,192 weights a program)
MERGE_BN = 32
MERGE_NB = 4
MERGE_WARPS = 4


@triton.jit
def _nf4_merge_kernel(Q, ABSMAX, ABSMAX2, CODE2, OFFSET, NF4, A, B, OUT, N, K, R, stride_a, stride_b,
                      BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                      BN: tl.constexpr, NB: tl.constexpr, RP: tl.constexpr, IEEE: tl.constexpr):
    HALF: tl.constexpr = BLOCKSIZE // 2
    HK: tl.constexpr = NB * HALF
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    kb = K // BLOCKSIZE  # quantisation blocks a row
    rows = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    qb = pid_k * NB + tl.arange(0, NB)
    row_ok = rows < N
    bm = row_ok[:, None] & (qb[None, :] < kb)
    blk = rows[:, None] * kb + qb[None, :]  # [BN, NB] global quantisation block
    amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk, bm, BLOCKSIZE2, NESTED)
    byte = blk[:, :, None] * HALF + tl.arange(0, HALF)[None, None, :]  # [BN, NB, HALF]
    b = tl.load(Q + byte, mask=bm[:, :, None], other=0).to(tl.int32)
    hi = tl.reshape(tl.load(NF4 + (b >> 4)) * amax[:, :, None], [BN, HK])  # even columns, fp32
    lo = tl.reshape(tl.load(NF4 + (b & 15)) * amax[:, :, None], [BN, HK])  # odd columns
    # the LoRA term of this tile: Bs[rows, :] @ A[:, even / odd columns]
    rr = tl.arange(0, RP)
    r_ok = rr < R
    col0 = pid_k * (NB * BLOCKSIZE)
    ce = col0 + 2 * tl.arange(0, HK)
    c_ok = ce < K
    bt = tl.load(B + rows[:, None] * stride_b + rr[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    a_ptr = A + rr[:, None] * stride_a + ce[None, :]
    a_m = r_ok[:, None] & c_ok[None, :]
    ae = tl.load(a_ptr, mask=a_m, other=0.0)
    ao = tl.load(a_ptr + 1, mask=a_m, other=0.0)
    if IEEE:
        hi += tl.dot(bt, ae, input_precision="ieee")
        lo += tl.dot(bt, ao, input_precision="ieee")
    else:
        hi += tl.dot(bt, ae)
        lo += tl.dot(bt, ao)
    vals = tl.reshape(tl.join(hi.to(OUT.dtype.element_ty), lo.to(OUT.dtype.element_ty)), [BN, 2 * HK])
    col = col0 + tl.arange(0, 2 * HK)
    tl.store(OUT + rows[:, None] * K + col[None, :], vals, mask=row_ok[:, None] & (col < K)[None, :])


def _check(state, A, Bs, dtype):
    n, k = (int(s) for s in state.shape)
    if A.dim() != 2 or Bs.dim() != 2 or A.shape[1] != k or Bs.shape[0] != n or Bs.shape[1] != A.shape[0]:
        raise ValueError(f"nf4_merged needs A [r, {k}] and Bs [{n}, r], got {tuple(A.shape)} and {tuple(Bs.shape)}")
    if A.dtype != dtype or Bs.dtype != dtype or dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"A, Bs and the output must share one of fp32/fp16/bf16, got {A.dtype}, {Bs.dtype}, {dtype}")
    if A.shape[0] > 128:
        raise ValueError(f"nf4_merged takes a LoRA rank up to 128, got {A.shape[0]}")
    return n, k


def nf4_merged_ref(packed, state, A, Bs, dtype=None) -> torch.Tensor:
    """The reference: (fp32 dequant(W) + Bs.float() @ A.float()) rounded once to ``dtype``."""
    st = _as_state(state)
    dtype = dtype or st.dtype
    _check(st, A, Bs, dtype)
    w = nf4_dequantize_ref(packed, st, torch.float32)
    return torch.addmm(w, Bs.float(), A.float()).to(dtype)


def nf4_merged(packed: torch.Tensor, state, A: torch.Tensor, Bs: torch.Tensor, dtype: torch.dtype | None = None,
               impl: str = "triton", *, bn: int | None = None, nb: int | None = None,
               num_warps: int | None = None) -> torch.Tensor:
    """W' [N, K] = dequant(W) + Bs @ A in ``dtype`` (default the state's), rounded once from fp32.

    ``packed``/``state``: bitsandbytes NF4 of W [N, K] (QuantState or NF4State); ``A`` [r, K] and
    ``Bs`` [N, r] (the LoRA scale folded into Bs) in ``dtype``. Launch knobs ``bn`` (rows a program,
    a power of two >= 16), ``nb`` (quantisation blocks of a row a program, a power of two).
    Raises ValueError (see the module docstring); ``impl`` "triton" | "reference"."""
    check_impl(impl)
    st = _as_state(state)
    dtype = dtype or st.dtype
    n, k = _check(st, A, Bs, dtype)
    bs = st.blocksize
    if k % bs:
        raise ValueError(f"nf4_merged needs in_features ({k}) to be a multiple of the blocksize ({bs})")
    if impl == "reference":
        return nf4_merged_ref(packed, st, A, Bs, dtype)
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    if n == 0 or k == 0:
        return out
    A = A if A.stride(1) == 1 else A.contiguous()
    Bs = Bs if Bs.stride(1) == 1 else Bs.contiguous()
    bn, nb = bn or MERGE_BN, nb or MERGE_NB
    if bn < 16 or bn & (bn - 1) or nb < 1 or nb & (nb - 1) or nb * bs // 2 < 16:
        raise ValueError("bn must be a power of two >= 16 and nb a power of two with nb * blocksize >= 32")
    nested = st.nested
    dummy = st.absmax
    offset = st.offset if not nested or st.offset.dtype == torch.float32 else st.offset.float()
    kwargs = {} if INTERPRET else {"enable_fp_fusion": False}
    grid = (-(-n // bn), -(-(k // bs) // nb))
    launch(_nf4_merge_kernel, grid, packed, st.absmax, st.absmax2 if nested else dummy,
           st.code2 if nested else dummy, offset if nested else dummy, _code(packed.device), A, Bs, out,
           n, k, A.shape[0], A.stride(0), Bs.stride(0), BLOCKSIZE=bs, BLOCKSIZE2=st.blocksize2 if nested else 1,
           NESTED=nested, BN=bn, NB=nb, RP=max(16, next_pow2(A.shape[0])), IEEE=dtype == torch.float32,
           num_warps=num_warps or MERGE_WARPS, **kwargs)
    return out
