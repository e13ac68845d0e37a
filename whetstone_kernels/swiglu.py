"""SwiGLU and GeGLU (gelu exact and tanh) gated activations in Triton, forward and backward.

Maths (elementwise over gate g and up u, fp32 arithmetic, one rounding on store):

    forward:  h  = act(g) * u
    backward: du = dh * act(g)          (activation recomputed from g, never saved)
              dg = dh * u * act'(g)
    silu(g) = g s, s = sigmoid(g);                 silu'(g) = s (1 + g (1 - s))
    gelu(g) = 0.5 g (1 + erf(g/sqrt2));            gelu'(g) = 0.5 (1 + erf(g/sqrt2)) + g exp(-g^2/2)/sqrt(2 pi)
    gelu_tanh(g) = 0.5 g (1 + t), t = tanh(k (g + 0.044715 g^3)), k = sqrt(2/pi)
              gelu_tanh'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 * 0.044715 g^2)

Saved for backward: g and u only (the inputs). Memory traffic: forward reads 2 and writes 1 tensor,
backward reads 3 and writes 2 (dg, du; ``inplace=True`` in the launcher writes them over g and u).
``glu_bwd(..., emit_h=True)`` also writes h = act(g) * u (the forward's bits) over dh, for a caller
that needs h again in backward (e.g. for a LoRA weight gradient) without a second pass over g and u.
Shapes: g, u any shape, same shape and dtype (made contiguous); dtypes fp32 / fp16 / bf16.
tanh is evaluated as 2 sigmoid(2z) - 1 (Triton has no portable tanh). Reference: whetstone_kernels/swiglu_ref.py.
Sources: Shazeer 2020 "GLU variants improve Transformer"; Hendrycks & Gimpel 2016 (GELU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_impl
from .launch import launch
from .swiglu_ref import glu_ref

_ACT_ID = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_BLOCK = 2048


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """Returns (act(g), act'(g)) in fp32."""
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    return a, da


@triton.jit
def _glu_fwd_kernel(G, U, H, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(H + offs, (a * u).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(DH, G, U, DG, DU, H, n, ACT: tl.constexpr, BLOCK: tl.constexpr, EMIT_H: tl.constexpr):
    """DG, DU [n] from DH, G, U [n] (one dtype); with EMIT_H also H [n] = act(G) * U, as _glu_fwd_kernel
    rounds it. H may be DH (each program loads its DH tile before any store), DG / DU may be G / U."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(DG + offs, (dh * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dh * a).to(DU.dtype.element_ty), mask=mask)
    if EMIT_H:
        tl.store(H + offs, (a * u).to(H.dtype.element_ty), mask=mask)


def _act_id(activation: str) -> int:
    if activation not in _ACT_ID:
        raise ValueError(f"activation must be one of {tuple(_ACT_ID)}, got {activation!r}")
    return _ACT_ID[activation]


def glu_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """h = act(gate) * up (same shape/dtype as gate)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError("gate and up must have the same shape and dtype")
    g, u = gate.contiguous(), up.contiguous()
    h = torch.empty_like(g)
    n = g.numel()
    if n:
        launch(_glu_fwd_kernel, (triton.cdiv(n, _BLOCK),), g, u, h, n, ACT=_act_id(activation), BLOCK=_BLOCK,
               num_warps=8)
    return h


def glu_bwd(dh, gate, up, activation: str = "silu", inplace: bool = False, emit_h: bool = False):
    """Returns (dgate, dup), same shape / dtype as gate; with inplace=True they are written over gate and
    up (which must be contiguous). With emit_h=True returns (dgate, dup, h): h = act(gate) * up,
    bit-identical to glu_fwd's, written over dh (consumed; dh must then have gate's shape and dtype, and
    be contiguous for h to alias it). inplace=True with emit_h=True allocates nothing."""
    if emit_h and (dh.shape != gate.shape or dh.dtype != gate.dtype):
        raise ValueError("emit_h writes h over dh: dh must have gate's shape and dtype")
    dh, g, u = dh.contiguous(), gate.contiguous(), up.contiguous()
    if inplace:
        dg, du = g, u
    else:
        dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        launch(_glu_bwd_kernel, (triton.cdiv(n, _BLOCK),), dh, g, u, dg, du, dh, n, ACT=_act_id(activation),
               BLOCK=_BLOCK, EMIT_H=emit_h, num_warps=8)
    return (dg, du, dh) if emit_h else (dg, du)


def swiglu_fwd(gate, up):
    return glu_fwd(gate, up, "silu")


def swiglu_bwd(dh, gate, up, inplace: bool = False):
    return glu_bwd(dh, gate, up, "silu", inplace)


def geglu_fwd(gate, up, approximate: str = "none"):
    return glu_fwd(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu")


def geglu_bwd(dh, gate, up, approximate: str = "none", inplace: bool = False):
    return glu_bwd(dh, gate, up, "gelu_tanh" if approximate == "tanh" else "gelu", inplace)


class GLUFunction(torch.autograd.Function):
    """Autograd wrapper: saves gate and up; backward recomputes act(gate)."""

    @staticmethod
    def forward(ctx, gate, up, activation="silu"):
        ctx.activation = activation
        ctx.save_for_backward(gate, up)
        return glu_fwd(gate, up, activation)

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dg, du = glu_bwd(dh, gate, up, ctx.activation)
        return dg, du, None


def glu(gate, up, activation: str = "silu", impl: str = "triton"):
    """act(gate) * up for activation in {"silu", "gelu", "gelu_tanh"}; impl "triton" | "reference"."""
    check_impl(impl)
    if impl == "reference":
        return glu_ref(gate, up, activation)
    return GLUFunction.apply(gate, up, activation)


def swiglu(gate, up, impl: str = "triton"):
    """silu(gate) * up."""
    return glu(gate, up, "silu", impl)


def geglu(gate, up, approximate: str = "none", impl: str = "triton"):
    """gelu(gate) * up; approximate "none" (erf) or "tanh", as in torch.nn.functional.gelu."""
    return glu(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu", impl)
