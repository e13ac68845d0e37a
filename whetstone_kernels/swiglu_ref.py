"""Gated-MLP activations, reference (plain PyTorch; oracle for whetstone_kernels/swiglu.py).

    SwiGLU:      h = silu(g) * u,                 silu(g) = g * sigmoid(g)
    GeGLU exact: h = gelu(g) * u,                 gelu(g) = 0.5 g (1 + erf(g / sqrt 2))
    GeGLU tanh:  h = gelu_tanh(g) * u,            gelu_tanh(g) = 0.5 g (1 + tanh(k (g + 0.044715 g^3))), k = sqrt(2/pi)

Backward: du = dh * act(g);  dg = dh * u * act'(g), with
    silu'(g)      = s (1 + g (1 - s)),  s = sigmoid(g)
    gelu'(g)      = 0.5 (1 + erf(g/sqrt 2)) + g exp(-g^2/2) / sqrt(2 pi)
    gelu_tanh'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 * 0.044715 g^2),  t = tanh(k (g + 0.044715 g^3))
Computed in fp32 (for fp16/bf16 inputs) and rounded once to the input dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _up(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def act_ref(g: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    if activation == "silu":
        return F.silu(g)
    if activation == "gelu":
        return F.gelu(g)
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    raise ValueError(f"unknown activation {activation!r}")


def glu_ref(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up, fp32 internally, result in gate's dtype; differentiable by autograd."""
    return (act_ref(_up(gate), activation) * _up(up)).to(gate.dtype)


def swiglu_ref(gate, up):
    return glu_ref(gate, up, "silu")


def geglu_ref(gate, up, approximate: str = "none"):
    return glu_ref(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu")


def act_grad_ref(g: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Closed-form act'(g) (the formulas in the module docstring)."""
    if activation == "silu":
        s = torch.sigmoid(g)
        return s * (1 + g * (1 - s))
    if activation == "gelu":
        return 0.5 * (1 + torch.erf(g / math.sqrt(2.0))) + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    k = math.sqrt(2.0 / math.pi)
    t = torch.tanh(k * (g + 0.044715 * g ** 3))
    return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)


def glu_ref_bwd(dh, gate, up, activation: str = "silu", emit_h: bool = False):
    """Closed-form backward; returns (dgate, dup) in the inputs' dtypes. With emit_h=True returns
    (dgate, dup, h), h = glu_ref(gate, up, activation) as a new tensor (dh is left as it is, unlike
    whetstone_kernels/swiglu.py's glu_bwd, which writes h over dh)."""
    g, u, d = _up(gate), _up(up), _up(dh)
    dg = d * u * act_grad_ref(g, activation)
    du = d * act_ref(g, activation)
    if emit_h:
        return dg.to(gate.dtype), du.to(up.dtype), glu_ref(gate, up, activation)
    return dg.to(gate.dtype), du.to(up.dtype)
