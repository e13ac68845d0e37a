"""RMSNorm reference (plain PyTorch, runs on CPU; the numerical oracle for whetstone_kernels/rms_norm.py).

Forward, per row x of length N (fp32 arithmetic, result cast to x.dtype):

    rstd = 1 / sqrt(mean(x**2) + eps)
    y    = x * rstd * w_eff,    w_eff = w (Llama/Qwen/Mistral)  or  1 + w (Gemma, ``gemma=True``)

Backward (xhat = x * rstd, g = dy * w_eff):

    dx = rstd * (g - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat

HF's LlamaRMSNorm rounds the normalised input to x.dtype before multiplying by w; this reference (like
the kernel) keeps fp32 until the single final rounding, which is at least as accurate. Gemma's norm
computes in fp32 and rounds once, exactly as here.
"""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, gemma: bool = False) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * (w or 1 + w); differentiable by autograd."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(xf.dtype)
    w = (1.0 + w) if gemma else w
    return (xf * rstd * w).to(x.dtype)


def rms_norm_ref_bwd(dy, x, weight, eps: float = 1e-6, gemma: bool = False):
    """Closed-form backward (the formulas above) in fp32 (fp64 for fp64 input); returns (dx, dw)."""
    up = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, dyf = x.to(up), dy.to(up)
    n = x.shape[-1]
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(up) + (1.0 if gemma else 0.0)
    xhat = xf * rstd
    g = dyf * w
    dx = rstd * (g - xhat * (g * xhat).sum(-1, keepdim=True) / n)
    dw = (dyf * xhat).reshape(-1, n).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)
