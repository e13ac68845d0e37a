"""Optimisers over the LoRA parameters and gradient clipping (for loops outside TRL's Trainer).

Inside the worker's runs TRL/transformers build the optimiser from ``TrainSpec.optim`` with the same
names; this module serves the benchmark and scripts:

* ``paged_adamw_8bit`` (default on CUDA): bitsandbytes ``PagedAdamW8bit``: the two moments in 8-bit
  blockwise-quantised form (2 bytes a parameter instead of 8), paged to host memory under pressure;
* ``adamw_8bit``: bitsandbytes ``AdamW8bit`` (not paged);
* ``adamw_torch``: ``torch.optim.AdamW`` (fused kernel on CUDA, fp32 moments).

Only parameters with ``requires_grad`` (the LoRA A/B) are optimised.
"""
from __future__ import annotations

import torch

NAMES = ("paged_adamw_8bit", "adamw_8bit", "adamw_torch")


def default_name() -> str:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001
        return "adamw_torch"
    return "paged_adamw_8bit" if torch.cuda.is_available() else "adamw_torch"


def make_optimizer(model, name: str | None = None, lr: float = 2e-4, weight_decay: float = 0.0,
                   betas=(0.9, 0.999), eps: float = 1e-8):
    """The optimiser ``name`` over the trainable parameters of ``model``."""
    name = name or default_name()
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    if name == "adamw_torch":
        fused = all(p.is_cuda for p in params)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                                 fused=fused or None)
    if name in ("paged_adamw_8bit", "adamw_8bit"):
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return cls(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    raise ValueError(f"optimizer must be one of {', '.join(NAMES)}, got {name!r}")


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """Clip the trainable parameters' gradients to ``max_norm`` (no-op for 0); returns the norm."""
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    if max_norm and max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])) if params \
        else torch.zeros(())
