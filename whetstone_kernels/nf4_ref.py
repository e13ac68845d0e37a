"""bitsandbytes NF4 4-bit weights, reference (plain PyTorch, CPU; oracle for whetstone_kernels/nf4.py).

Written from the bitsandbytes format (``quantize_4bit(..., quant_type="nf4", blocksize=64,
compress_statistics=True)``), without importing bitsandbytes:

* the weight W (numel n) is flattened and cut into blocks of ``blocksize`` (64) elements;
  absmax[j] = max |W| over block j (fp32);
* each element is replaced by the index (0..15) of the nearest NF4 code value to W / absmax[j];
* two indices per byte, the element with the even index in the HIGH nibble: byte i = (q[2i] << 4) | q[2i+1];
* double quantisation ("compress_statistics"): offset = mean(absmax); (absmax - offset) is quantised
  blockwise (``blocksize2`` = 256 absmax values per nested block) to uint8 indices into bitsandbytes'
  signed dynamic 8-bit map ``code2`` (256 values) with fp32 scales absmax2[n_blocks / 256].

Dequantisation, in exactly bitsandbytes' order of fp32 roundings (so the result is bit-exact):

    absmax[j] = fl(fl(code2[qabsmax[j]] * absmax2[j // blocksize2]) + offset)      (nested)
    W[e]      = to_dtype(fl(NF4[nibble(e)] * absmax[e // blocksize]))             (round to nearest even)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The 16 NF4 levels: quantiles of N(0, 1) scaled to [-1, 1] with an exact zero (Dettmers et al. 2023,
# QLoRA, appendix E); these are the fp32 constants bitsandbytes uses.
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)


def nf4_code(device=None) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def dynamic_map_signed() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True), 7 exponent bits):
    for decade i = 0..6, 2**i linearly spaced fraction midpoints in [0.1, 1] times 10**(i - 6), both
    signs; plus 0 and 1; sorted. 2 * 127 + 2 = 256 values."""
    data = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-6 + i)
        data += (scale * means).tolist() + (-scale * means).tolist()  # fp32 products, as bitsandbytes
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


@dataclass
class NF4State:
    """What is needed to dequantise (attribute names follow bitsandbytes' QuantState)."""
    absmax: torch.Tensor            # uint8 [n_blocks] if nested, else fp32 [n_blocks]
    shape: tuple
    dtype: torch.dtype
    blocksize: int = 64
    offset: torch.Tensor | None = None   # fp32 scalar tensor (nested only)
    absmax2: torch.Tensor | None = None  # fp32 [ceil(n_blocks / blocksize2)]
    code2: torch.Tensor | None = None    # fp32 [256]
    blocksize2: int = 256

    @property
    def nested(self) -> bool:
        return self.absmax2 is not None


def nf4_state_from_bnb(qs) -> NF4State:
    """Read a bitsandbytes QuantState (duck-typed; bitsandbytes is not imported)."""
    if getattr(qs, "quant_type", "nf4") != "nf4":
        raise ValueError("only NF4 is supported")
    s2 = getattr(qs, "state2", None)
    nested = s2 is not None and getattr(qs, "nested", True)
    return NF4State(absmax=qs.absmax, shape=tuple(qs.shape), dtype=qs.dtype, blocksize=qs.blocksize,
                    offset=qs.offset if nested else None, absmax2=s2.absmax if nested else None,
                    code2=s2.code if nested else None, blocksize2=s2.blocksize if nested else 256)


def _nearest(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    mids = (code[1:] + code[:-1]) / 2
    return torch.bucketize(x, mids)


def nf4_quantize_ref(w: torch.Tensor, blocksize: int = 64, double_quant: bool = True, blocksize2: int = 256):
    """Quantise w to (packed uint8 [ceil(n/2), 1], NF4State). Used to make test/bench inputs anywhere."""
    flat = w.detach().float().flatten()
    n = flat.numel()
    nb = -(-n // blocksize)
    padded = torch.zeros(nb * blocksize, device=w.device)
    padded[:n] = flat
    blocks = padded.view(nb, blocksize)
    absmax = blocks.abs().amax(1)
    q = _nearest((blocks / absmax.clamp_min(1e-30)[:, None]).flatten(), nf4_code(w.device))[:n]
    if n % 2:
        q = torch.cat([q, q.new_zeros(1)])
    packed = ((q[0::2] << 4) | q[1::2]).to(torch.uint8).unsqueeze(1)
    state = NF4State(absmax=absmax, shape=tuple(w.shape), dtype=w.dtype, blocksize=blocksize)
    if double_quant:
        offset = absmax.mean()
        c = absmax - offset
        nb2 = -(-nb // blocksize2)
        cp = torch.zeros(nb2 * blocksize2, device=w.device)
        cp[:nb] = c
        absmax2 = cp.view(nb2, blocksize2).abs().amax(1)
        code2 = dynamic_map_signed().to(w.device)
        qa = _nearest((cp.view(nb2, blocksize2) / absmax2.clamp_min(1e-30)[:, None]).flatten(), code2)[:nb]
        state = NF4State(absmax=qa.to(torch.uint8), shape=tuple(w.shape), dtype=w.dtype, blocksize=blocksize,
                         offset=offset, absmax2=absmax2, code2=code2, blocksize2=blocksize2)
    return packed, state


def dequant_absmax_ref(state: NF4State) -> torch.Tensor:
    """fp32 absmax per 64-block, undoing the double quantisation (bitsandbytes' rounding order)."""
    if not state.nested:
        return state.absmax.float()
    idx = torch.arange(state.absmax.numel(), device=state.absmax.device) // state.blocksize2
    scaled = state.code2.float()[state.absmax.long()] * state.absmax2.float()[idx]
    return scaled + state.offset.float()


def nf4_dequantize_ref(packed: torch.Tensor, state: NF4State, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantise to ``dtype`` (default: state.dtype) with state.shape."""
    dtype = dtype or state.dtype
    n = 1
    for s in state.shape:
        n *= int(s)
    b = packed.flatten().to(torch.int64)
    q = torch.stack([b >> 4, b & 15], dim=1).flatten()[:n]
    absmax = dequant_absmax_ref(state)
    vals = nf4_code(packed.device)[q] * absmax[torch.arange(n, device=packed.device) // state.blocksize]
    return vals.to(dtype).view(state.shape)


def nf4_linear_ref(x: torch.Tensor, packed: torch.Tensor, state: NF4State, bias=None) -> torch.Tensor:
    """x @ W^T (+ bias) with W dequantised to x's dtype; differentiable w.r.t. x (W is frozen)."""
    w = nf4_dequantize_ref(packed, state, x.dtype)
    y = x @ w.t()
    return y + bias if bias is not None else y
