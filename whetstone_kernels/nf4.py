"""NF4 (bitsandbytes 4-bit, blocksize 64, double-quantised absmax) dequantisation in Triton.

Maths (bit-exact with bitsandbytes' dequantize_4bit; see whetstone_kernels/nf4_ref.py for the format):

    absmax[j] = fl(fl(code2[qabsmax[j]] * absmax2[j // 256]) + offset)     (nested; else fp32 absmax[j])
    W[2i]     = to_dtype(fl(NF4[byte[i] >> 4] * absmax[2i // 64]))
    W[2i+1]   = to_dtype(fl(NF4[byte[i] & 15] * absmax[2i // 64]))

Each program takes a tile of ROWS = elems / blocksize quantisation blocks x blocksize / 2 packed
bytes (one contiguous vector load per thread): the absmax is dequantised once per block, each byte's
two nibbles are looked up (a 16-entry fp32 table), scaled and rounded to the output dtype, then either
joined and stored interleaved (``pack=False``) or, with ``pack=True``, bit-packed into one 32-bit
(16-bit dtypes) or 64-bit (fp32) word per byte, element 2i in the low half (little-endian: lower
address), and stored through a word view of the output (an odd n stores its last element alone). Both
stores are contiguous and give identical bits; tile size, num_warps and the store are launch knobs
(``nf4_fwd(elems=, num_warps=, pack=)``; defaults NF4_ELEMS / NF4_WARPS / NF4_PACK, the fastest
exact configuration of bench/nf4_dequant_sweep.py on an H200). fp-contraction (FMA) is switched off at launch
(``enable_fp_fusion=False``) so the absmax is rounded twice, as bitsandbytes does. Traffic: n/2
bytes read, n * sizeof(dtype) written (+ n/64 bytes of absmax).

As an autograd op, ``NF4LinearFunction`` computes y = x W^T with W dequantised into a temporary that
is freed at once; backward re-dequantises W (nothing but x's shape is saved) and returns dx = dy W.
W is frozen (no weight gradient). ``nf4_fwd`` is the dequantisation; ``nf4_bwd`` the linear backward.
Dtypes: packed uint8, output fp32/fp16/bf16. Source: Dettmers et al. 2023 (QLoRA); bitsandbytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_impl
from .launch import bound as launch_bound
from .launch import launch
from .nf4_ref import NF4State, nf4_code, nf4_dequantize_ref, nf4_linear_ref, nf4_state_from_bnb

# launch defaults of the dequantisation: the fastest exact config of bench/nf4_dequant_sweep.py on an H200
# (s5-c2: [14336, 4096] bf16 40.4 us = 3.65 TB/s, was 61.2; [4096, 4096] 14.5 us; [1024, 4096] 7.2 us)
NF4_ELEMS = 4096
NF4_WARPS = 4
NF4_PACK = False   # store two outputs as one word (True) or join + interleave (False); same bits
_CODE_CACHE: dict = {}


@triton.jit
def block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk, bm, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr):
    """fp32 absmax of quantisation blocks ``blk`` (masked by ``bm``): code2[q] * absmax2 + offset
    when double-quantised (two roundings, as bitsandbytes), else the stored fp32 absmax."""
    if NESTED:
        qa = tl.load(ABSMAX + blk, mask=bm, other=0).to(tl.int32)
        scaled = tl.load(CODE2 + qa) * tl.load(ABSMAX2 + blk // BLOCKSIZE2, mask=bm, other=0.0)
        amax = scaled + tl.load(OFFSET)
    else:
        amax = tl.load(ABSMAX + blk, mask=bm, other=0.0)
    return amax


@triton.jit
def _pair_word(hi, lo, BITS: tl.constexpr):
    """Two output values (already in the output dtype, BITS = 16 or 32 wide) as one unsigned word of
    2 * BITS bits: ``hi`` (element 2i) in the low half, so it lands at the lower address (little-endian)."""
    if BITS == 16:
        word = hi.to(tl.uint16, bitcast=True).to(tl.uint32) | (lo.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
    else:
        word = hi.to(tl.uint32, bitcast=True).to(tl.uint64) | (lo.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
    return word


@triton.jit
def _dequant_tile(pid, Q, ABSMAX, ABSMAX2, CODE2, OFFSET, NF4, OUT, n_out, n_bytes, n_blocks,
                  BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                  ROWS: tl.constexpr, HALF: tl.constexpr, PACK: tl.constexpr, BITS: tl.constexpr,
                  ODD: tl.constexpr):
    """Tile ``pid`` of one weight: ROWS quantisation blocks x HALF = BLOCKSIZE/2 packed bytes of Q
    (uint8 [n_bytes = ceil(n_out / 2)]) -> OUT (BITS-wide float) [n_out], absmax computed once per
    block; a tile past n_blocks stores nothing. ODD (PACK only): n_out is odd."""
    blk = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bm = blk < n_blocks
    amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk, bm, BLOCKSIZE2, NESTED)
    byte = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]  # packed byte i holds elements 2i (high), 2i+1
    b = tl.load(Q + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    hi = (tl.load(NF4 + (b >> 4)) * amax[:, None]).to(OUT.dtype.element_ty)
    lo = (tl.load(NF4 + (b & 15)) * amax[:, None]).to(OUT.dtype.element_ty)
    if PACK:
        # word i of the output = elements (2i, 2i+1): one contiguous 2*BITS-bit store per byte, no shuffle
        if BITS == 16:
            words = OUT.to(tl.pointer_type(tl.uint32), bitcast=True)
        else:
            words = OUT.to(tl.pointer_type(tl.uint64), bitcast=True)
        tl.store(words + byte, _pair_word(hi, lo, BITS), mask=byte < n_out // 2)
        if ODD:  # n odd: the last byte's high nibble is the last element, its low nibble is padding
            tl.store(OUT + 2 * byte, hi, mask=byte == n_out // 2)
    else:
        vals = tl.reshape(tl.join(hi, lo), [ROWS, BLOCKSIZE])
        idx = blk[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
        tl.store(OUT + idx, vals, mask=idx < n_out)


@triton.jit
def _nf4_dequant_kernel(Q, ABSMAX, ABSMAX2, CODE2, OFFSET, NF4, OUT, n_out, n_bytes, n_blocks,
                        BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
                        ROWS: tl.constexpr, HALF: tl.constexpr, PACK: tl.constexpr, BITS: tl.constexpr,
                        ODD: tl.constexpr):
    """Q uint8 [n_bytes = ceil(n_out / 2)] -> OUT (BITS-wide float) [n_out]; NF4 the fp32 [16] code.
    One program: one tile (:func:`_dequant_tile`)."""
    _dequant_tile(tl.program_id(0), Q, ABSMAX, ABSMAX2, CODE2, OFFSET, NF4, OUT, n_out, n_bytes, n_blocks,
                  BLOCKSIZE, BLOCKSIZE2, NESTED, ROWS, HALF, PACK, BITS, ODD)


def _as_state(state) -> NF4State:
    return state if isinstance(state, NF4State) else nf4_state_from_bnb(state)


def _code(device) -> torch.Tensor:
    if device not in _CODE_CACHE:
        _CODE_CACHE[device] = nf4_code(device)
    return _CODE_CACHE[device]


def nf4_fwd(packed: torch.Tensor, state, dtype: torch.dtype | None = None, out: torch.Tensor | None = None, *,
            elems: int | None = None, num_warps: int | None = None, pack: bool | None = None) -> torch.Tensor:
    """Dequantise bitsandbytes NF4 ``packed`` (uint8, ceil(n/2) bytes) with its QuantState / NF4State to
    ``dtype`` (fp32 / fp16 / bf16; default the state's), shape state.shape; ``out`` (contiguous) is
    written if given. Launch knobs (results are bit-identical whatever they are): ``elems`` output
    elements per program (power of two; default NF4_ELEMS), ``num_warps`` (default NF4_WARPS),
    ``pack`` store each byte's two outputs as one 32/64-bit word, else join + interleaved store
    (default NF4_PACK; an ``out`` not aligned to two elements always takes the interleaved store)."""
    st = _as_state(state)
    dtype = dtype or st.dtype
    if out is None:
        out = torch.empty(st.shape, dtype=dtype, device=packed.device)
    call = _dequant_call(packed, st, out, elems, num_warps, pack)
    if call is not None:
        launch(_nf4_dequant_kernel, call[0], *call[1], **call[2])
    return out


def _dequant_call(packed, st: NF4State, out, elems=None, num_warps=None, pack=None):
    """(grid, args, kw) of the dequantisation of ``packed`` into ``out`` (see :func:`nf4_fwd`),
    or None for an empty weight. Raises ValueError for a blocksize or ``elems`` that is not a
    power of two."""
    n = 1
    for s in st.shape:
        n *= int(s)
    bs = st.blocksize
    if bs < 2 or bs & (bs - 1):
        raise ValueError("blocksize must be a power of two")
    elems = elems or NF4_ELEMS
    if elems < 1 or elems & (elems - 1):
        raise ValueError("elems must be a power of two")
    if not n:
        return None
    size = out.element_size()
    pack = (NF4_PACK if pack is None else pack) and out.data_ptr() % (2 * size) == 0
    nested = st.nested
    absmax = st.absmax
    dummy = absmax
    offset = st.offset if not nested or st.offset.dtype == torch.float32 else st.offset.float()
    n_blocks = -(-n // bs)
    rows = max(1, elems // bs)
    kwargs = {} if INTERPRET else {"enable_fp_fusion": False}
    args = (packed, absmax, st.absmax2 if nested else dummy, st.code2 if nested else dummy,
            offset if nested else dummy, _code(packed.device), out, n, (n + 1) // 2, n_blocks)
    kw = dict(BLOCKSIZE=bs, BLOCKSIZE2=st.blocksize2 if nested else 1, NESTED=nested, ROWS=rows,
              HALF=bs // 2, PACK=pack, BITS=8 * size, ODD=pack and n % 2 == 1,
              num_warps=num_warps or NF4_WARPS, **kwargs)
    return (-(-n_blocks // rows),), args, kw


_OUT_SLOT = 6  # OUT's place in _nf4_dequant_kernel's arguments


def nf4_dequantizer(packed: torch.Tensor, state, dtype: torch.dtype | None = None):
    """A callable ``() -> W`` that dequantises ``packed`` (with ``state``) into a new
    [out, in] tensor of ``dtype``, exactly as :func:`nf4_fwd` does, with the launch's arguments
    bound once (:func:`whetstone_kernels.launch.bound`): per call one ``torch.empty`` and one
    launch, none of nf4_fwd's argument work. For a weight dequantised again and again with the
    same buffers (a frozen base: forward, recompute and backward of every step).

    The callable holds ``packed`` and the state's tensors (so their addresses stay valid) and
    reads them as they are when it was made: a caller that replaces them (a move to another
    device) makes a new one. Each call falls
    back to :func:`nf4_fwd` when the direct launch does not apply then (a launch hook, another
    current device, an output address not 16-byte aligned). Returns (callable, W of this first
    call, through nf4_fwd); the callable is nf4_fwd itself where binding does not apply (the
    interpreter, no direct path, an empty weight)."""
    st = _as_state(state)
    dtype = dtype or st.dtype
    first = nf4_fwd(packed, st, dtype)  # registers the launch plan (and compiles) if need be

    def slow():
        return nf4_fwd(packed, st, dtype)

    call = _dequant_call(packed, st, first)
    run = None if call is None or first.data_ptr() % 16 else \
        launch_bound(_nf4_dequant_kernel, call[0], call[1], call[2], _OUT_SLOT)
    if run is None:
        return slow, first
    shape, device = st.shape, packed.device

    def fast():
        w = torch.empty(shape, dtype=dtype, device=device)
        p = w.data_ptr()
        if p % 16 or not run(p):
            nf4_fwd(packed, st, dtype, out=w)
        return w

    return fast, first


def nf4_bwd(dy: torch.Tensor, packed: torch.Tensor, state) -> torch.Tensor:
    """Backward of y = x W^T w.r.t. x: dy @ W, W re-dequantised to dy's dtype."""
    w = nf4_fwd(packed, state, dy.dtype)
    return dy @ w


class NF4LinearFunction(torch.autograd.Function):
    """y = x @ dequant(W)^T; saves nothing of W (re-dequantised in backward)."""

    @staticmethod
    def forward(ctx, x, packed, state):
        ctx.state = state
        ctx.save_for_backward(packed)
        w = nf4_fwd(packed, state, x.dtype)
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        (packed,) = ctx.saved_tensors
        return nf4_bwd(dy, packed, ctx.state), None, None


def nf4_dequantize(packed, state, dtype=None, impl: str = "triton"):
    """Dequantise bitsandbytes NF4 weights; impl "triton" | "reference" (bit-identical results)."""
    check_impl(impl)
    if impl == "reference":
        return nf4_dequantize_ref(packed, _as_state(state), dtype)
    return nf4_fwd(packed, state, dtype)


def nf4_linear(x, packed, state, bias=None, impl: str = "triton"):
    """x @ W^T (+ bias) for a frozen NF4 weight W; differentiable w.r.t. x (and bias)."""
    check_impl(impl)
    if impl == "reference":
        return nf4_linear_ref(x, packed, _as_state(state), bias)
    y = NF4LinearFunction.apply(x, packed, state)
    return y + bias if bias is not None else y
