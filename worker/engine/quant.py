"""Frozen NF4 base weights (bitsandbytes layout) for the LoRA engine.

:class:`NF4Linear` replaces the frozen ``base_layer`` of a PEFT ``lora.Linear`` (or a plain
``nn.Linear``) and holds only the packed weight:

* ``packed``  uint8 [ceil(out*in/2), 1]  two 4-bit NF4 indices a byte (even element in the high nibble);
* ``absmax``  uint8 [n_blocks]           double-quantised per-64-block scale indices (``absmax2``
  fp32 [ceil(n_blocks/256)], ``code2`` fp32 [256], ``offset`` fp32 scalar undo the nesting);
* ``bias``    frozen, in the compute dtype, or None.

The data are produced by bitsandbytes' own ``quantize_4bit(blocksize=64, compress_statistics=True,
quant_type="nf4")`` (CPU or CUDA backend), so the layout is bitsandbytes' exactly; a layer of a
pre-quantised bnb-4bit checkpoint (``bnb.nn.Linear4bit``) is converted without requantising. The
dense weight is never stored: ``dequant(dtype)`` materialises it in a temporary through
``whetstone_kernels.nf4`` (impl "triton" on CUDA, "reference" elsewhere), which the fused LoRA functions call
in forward and again in backward. Memory: 0.5 byte a weight + 1 byte per 64 (+ 4 bytes per 16384).

Generation cache (:mod:`worker.engine.gencache`): ``cache_dense()`` keeps one dense W [out, in] in
the original dtype (bf16 on GPU: 2 bytes a weight) until ``drop_dense()``; while it is held,
``forward`` and ``dequant`` use it instead of dequantising. ``dequants`` counts the dequantisations
this module ran (tests assert decode does not re-dequantise per token). On CUDA with the Triton
kernels each dtype's dequantisation is launched through a callable bound to the module's buffers
(``whetstone_kernels.nf4.nf4_dequantizer``: one allocation and one launch a call), re-made when the
buffers are replaced.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("worker.engine.quant")


class NF4Linear(nn.Module):
    """y = x W^T (+ b) with W [out, in] kept as bitsandbytes NF4; frozen (no parameters train)."""

    def __init__(self, packed, absmax, shape, dtype, blocksize=64, offset=None, absmax2=None,
                 code2=None, blocksize2=256, bias=None, impl: str = "reference"):
        super().__init__()
        self.out_features, self.in_features = int(shape[0]), int(shape[1])
        self.register_buffer("packed", packed)
        self.register_buffer("absmax", absmax)
        self.register_buffer("absmax2", absmax2)
        self.register_buffer("code2", code2)
        self.register_buffer("offset", None if offset is None else offset.reshape(()).float())
        self.shape, self.dtype, self.blocksize, self.blocksize2 = (tuple(shape), dtype, blocksize,
                                                                  blocksize2)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.impl = impl
        self._dense: torch.Tensor | None = None
        self._dequantizers: dict = {}  # dtype -> (the buffers it was bound to, callable)
        self.dequants = 0

    @property
    def weight(self):  # PEFT/transformers introspection (device, dtype checks) sees the packed data
        return self.packed

    def state(self):
        """The kernels' NF4State (views of this module's buffers)."""
        from whetstone_kernels.nf4_ref import NF4State

        return NF4State(absmax=self.absmax, shape=self.shape, dtype=self.dtype,
                        blocksize=self.blocksize, offset=self.offset, absmax2=self.absmax2,
                        code2=self.code2, blocksize2=self.blocksize2)

    def dequant(self, dtype=None) -> torch.Tensor:
        """A dense W [out, in] in ``dtype`` (default: the original dtype): a temporary, or the
        cached one (see :meth:`cache_dense`)."""
        from whetstone_kernels.nf4 import nf4_dequantize

        dtype = dtype or self.dtype
        if self._dense is not None:
            return self._dense if self._dense.dtype == dtype else self._dense.to(dtype)
        self.dequants += 1
        if self.impl != "triton" or not self.packed.is_cuda:
            return nf4_dequantize(self.packed, self.state(), dtype, impl=self.impl)
        bufs = (self.packed, self.absmax, self.absmax2, self.code2, self.offset)
        bound = self._dequantizers.get(dtype)
        if bound is not None and all(a is b for a, b in zip(bound[0], bufs)):
            return bound[1]()
        from whetstone_kernels.nf4 import nf4_dequantizer

        # the launch bound to these buffers (re-made when one is replaced: .to(), _apply)
        fn, w = nf4_dequantizer(self.packed, self.state(), dtype)
        self._dequantizers[dtype] = (bufs, fn)
        return w

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .float() replace the buffers: forget the dequantisers bound to the old
        # ones (they hold them, so they would keep the old GPU memory alive until the next call)
        self._dequantizers = {}
        return super()._apply(fn, *args, **kwargs)

    def cache_dense(self) -> int:
        """Dequantise once and keep W (original dtype) until :meth:`drop_dense`; returns bytes."""
        if self._dense is None:
            self._dense = self.dequant(self.dtype)
        return self._dense.numel() * self._dense.element_size()

    def drop_dense(self) -> None:
        self._dense = None

    def dense_bytes(self) -> int:
        """Bytes :meth:`cache_dense` holds: out * in * itemsize(original dtype)."""
        return self.out_features * self.in_features * torch.finfo(self.dtype).bits // 8

    def forward(self, x):
        if self._dense is not None:  # the same maths as nf4_linear_ref, without the dequant
            w = self._dense if self._dense.dtype == x.dtype else self._dense.to(x.dtype)
            y = x @ w.t()
            return y + self.bias if self.bias is not None else y
        from whetstone_kernels.nf4 import nf4_linear

        self.dequants += 1
        return nf4_linear(x, self.packed, self.state(), self.bias, impl=self.impl)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, nf4, "
                f"bias={self.bias is not None}, impl={self.impl}")

    @classmethod
    def from_bnb(cls, packed, quant_state, bias=None, impl="reference") -> "NF4Linear":
        """Wrap bitsandbytes' packed data + QuantState (from quantize_4bit or a Linear4bit)."""
        from whetstone_kernels.nf4_ref import nf4_state_from_bnb

        st = nf4_state_from_bnb(quant_state)
        return cls(packed, st.absmax, st.shape, st.dtype, st.blocksize, st.offset, st.absmax2,
                   st.code2, st.blocksize2, bias, impl)


def quantize_weight(weight: torch.Tensor, device=None):
    """bitsandbytes NF4 (blocksize 64, double-quantised) of ``weight`` on ``device``.

    Returns (packed uint8 [n/2, 1], QuantState). The dense copy on ``device`` is freed on return.
    """
    import bitsandbytes.functional as bnbf

    w = weight.detach().to(device or weight.device)
    packed, qs = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    return packed, qs


def nf4_from_linear(linear: nn.Module, impl: str, device=None) -> NF4Linear:
    """An :class:`NF4Linear` from a dense ``nn.Linear`` or a bitsandbytes ``Linear4bit``."""
    w = linear.weight
    bias = linear.bias
    qs = getattr(w, "quant_state", None)
    if qs is not None:  # already bitsandbytes 4-bit (pre-quantised checkpoint)
        return NF4Linear.from_bnb(w.data, qs, bias, impl)
    packed, qs = quantize_weight(w, device)
    if bias is not None:
        bias = bias.detach().to(packed.device)
    return NF4Linear.from_bnb(packed, qs, bias, impl)


def is_quantized_base(module: nn.Module) -> bool:
    return isinstance(module, NF4Linear) or getattr(getattr(module, "weight", None),
                                                    "quant_state", None) is not None


def quantize_lora_bases(model: nn.Module, impl: str, device=None) -> int:
    """Replace the frozen base layer of every PEFT LoRA linear in ``model`` by an NF4Linear.

    Also converts bitsandbytes Linear4bit bases (pre-quantised checkpoints). Moves each dense weight
    to ``device`` one at a time, so peak memory there is the quantised model plus one dense layer.
    Returns how many layers were quantised.
    """
    n = 0
    for _name, mod in list(model.named_modules()):
        base = getattr(mod, "base_layer", None)
        if base is None or not hasattr(mod, "lora_A") or isinstance(base, NF4Linear):
            continue
        if not (isinstance(base, nn.Linear) or is_quantized_base(base)):
            continue
        q = nf4_from_linear(base, impl, device)
        mod.base_layer = q
        del base
        n += 1
    return n


def dense_weight(base: nn.Module, dtype) -> torch.Tensor:
    """The base weight [out, in] in ``dtype``: dequantised temporary (NF4) or the parameter itself."""
    if isinstance(base, NF4Linear):
        return base.dequant(dtype)
    w = base.weight
    return w if w.dtype == dtype else w.to(dtype)


def dense_weights(bases, dtype) -> list:
    """[W_p [out_p, in] in ``dtype``] for the frozen bases of one projection group, each
    :func:`dense_weight` (one place to count or intercept a group's weight fetches)."""
    return [dense_weight(b, dtype) for b in bases]
