"""LM head + cross-entropy reference (plain PyTorch; oracle for whetstone_kernels/cross_entropy.py).

For hidden states h [T, H], head weight W [V, H] and labels y [T] (already shifted; -100 = ignore):

    z     = h W^T                                   (logits, in h's dtype, then fp32 as HF does)
    z     = c tanh(z / c)                           (Gemma-2 final logit soft-capping, if c is given)
    l_t   = logsumexp(z_t) - z_t[y_t]               for tokens with y_t != ignore_index, else 0
    loss  = sum_t l_t / n,   n = #non-ignored tokens ("mean", 0 if there are none)
                             or n = normaliser       ("sum"; normaliser=1 gives the plain sum; pass the
                                                       token count of the whole accumulated batch to
                                                       normalise per token across gradient accumulation)
Gradients: dz_t = (softmax(z_t) - onehot(y_t)) / n  (times (1 - tanh^2) when capped);
           dh = dz W;  dW = dz^T h.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             ignore_index: int = -100, softcap: float | None = None, reduction: str = "mean",
                             normaliser=None, upcast: bool = False) -> torch.Tensor:
    """Materialises all [T, V] logits (fp32). ``upcast=True`` does the matmul in fp32 too (a reference
    with no low-precision rounding, for error budgets)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if upcast:
        logits = h.double() @ weight.double().t() if h.dtype == torch.float64 else h.float() @ weight.float().t()
    else:
        logits = (h @ weight.t()).float() if h.dtype != torch.float64 else h @ weight.t()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    total = F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")
    if reduction == "mean":
        return total / (y != ignore_index).sum().clamp_min(1)
    if reduction == "sum":
        return total / (1.0 if normaliser is None else normaliser)
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
