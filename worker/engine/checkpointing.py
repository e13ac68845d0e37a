"""Per-decoder-layer activation checkpointing, offloaded to pinned CPU memory, under a VRAM budget.

:func:`checkpoint_layer` runs ``fn(h)`` (one decoder layer, h [B, S, H]) without keeping its
activations: forward runs under ``no_grad`` and saves only the layer input h; backward recomputes the
layer with grad enabled and back-propagates through it (reentrant style: the LoRA parameters' .grad
are accumulated by that inner backward, dh is returned). On CUDA the saved input is copied to a
pinned host buffer on a side stream (``non_blocking``, the buffer pool is reused across steps, the
GPU copy is released once the copy is done via ``record_stream``) and copied back on the compute
stream in backward. The RNG state is restored for the recompute when ``preserve_rng`` (dropout).

Recompute skip: while backward recomputes a layer, :func:`recomputing` is true (thread-local: the
autograd worker thread). The value ``fn`` returns then is discarded (only the graph it builds is
back-propagated), so work that feeds *only* that value may be skipped: :func:`~worker.engine.patch.
run_layer` skips the MLP's down projection (its output goes straight into ``h + m``), see
:mod:`worker.engine.lora_ops`. A ``fn`` that reads the flag must be one layer whose return is that
value (not several layers chained in one checkpoint).

:func:`plan_layers` is the budget: given the bytes one layer's activations take when *not*
checkpointed (:func:`layer_activation_bytes`), the memory already in use and the budget, it returns
how many layers keep their activations on the GPU (run plainly, never recomputed); the rest are
checkpointed. ``budget=None`` checkpoints every layer (the least memory).
"""
from __future__ import annotations

import contextlib
import math
import threading

import torch

_local = threading.local()


def recomputing() -> bool:
    """True while a checkpointed layer is recomputed in backward (its returned value is unused)."""
    return getattr(_local, "recompute", False)


@contextlib.contextmanager
def _recompute():
    prev = recomputing()
    _local.recompute = True
    try:
        yield
    finally:
        _local.recompute = prev


class Offloader:
    """Pinned host buffers, one per (layer, shape, dtype), and a side stream for D2H copies."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and torch.cuda.is_available()
        self.buffers: dict = {}
        self.stream = torch.cuda.Stream() if self.enabled else None

    def save(self, key, h: torch.Tensor):
        """Returns a handle; with offloading the GPU tensor may be freed by the caller at once."""
        if not (self.enabled and h.is_cuda):
            return ("dev", h)
        k = (key, tuple(h.shape), h.dtype)
        buf = self.buffers.get(k)
        if buf is None:
            buf = self.buffers[k] = torch.empty(h.shape, dtype=h.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            buf.copy_(h, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        h.record_stream(self.stream)
        return ("host", buf, ev, h.device)

    @staticmethod
    def load(handle) -> torch.Tensor:
        if handle[0] == "dev":
            return handle[1]
        _, buf, ev, dev = handle
        torch.cuda.current_stream().wait_event(ev)
        return buf.to(dev, non_blocking=True)


def _rng_state(device):
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, cuda


def _set_rng_state(state, device):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, offloader, key, preserve_rng, h):
        ctx.fn, ctx.preserve_rng = fn, preserve_rng
        ctx.autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) \
            if h.is_cuda else (False, None)
        if preserve_rng:
            ctx.rng = _rng_state(h.device)
        with torch.no_grad():
            out = fn(h)
        ctx.handle = offloader.save(key, h.detach())
        return out

    @staticmethod
    def backward(ctx, dout):
        h = Offloader.load(ctx.handle).detach().requires_grad_(True)
        ctx.handle = None
        state = None
        if ctx.preserve_rng:
            state = _rng_state(h.device)
            _set_rng_state(ctx.rng, h.device)
        try:
            with torch.enable_grad(), torch.autocast("cuda", enabled=ctx.autocast[0],
                                                     dtype=ctx.autocast[1] or torch.bfloat16), \
                    _recompute():
                out = ctx.fn(h)
            torch.autograd.backward(out, dout)
        finally:
            if state is not None:
                _set_rng_state(state, h.device)
        return None, None, None, None, h.grad


def checkpoint_layer(fn, h: torch.Tensor, offloader: Offloader, key, preserve_rng=False):
    """fn(h) with its activations recomputed in backward; h must require grad (see module doc).

    In the recompute :func:`recomputing` is true and fn's returned value is discarded.
    """
    if not h.requires_grad:
        h = h.detach().requires_grad_(True)
    return _CheckpointFunction.apply(fn, offloader, key, preserve_rng, h)


def layer_activation_bytes(config, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes one decoder layer keeps for backward when it is not checkpointed (fused engine path).

    Per token: residual/norm inputs and outputs and the attention in/out (~6 hidden), q and its
    rotated copy are views/kernel outputs (counted in those 6), k and v twice (pre/post RoPE),
    the MLP's saved gate and up (2 intermediate), plus the SDPA logsumexp (fp32, one per head).
    A 15 % margin covers allocator rounding.
    """
    h = config.hidden_size
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", heads) * hd
    inter = config.intermediate_size
    per_tok = (6 * h + 4 * kv + 2 * inter) * dtype_bytes + 4 * heads
    return int(math.ceil(per_tok * tokens * 1.15))


def plan_layers(n_layers: int, per_layer: int, budget_bytes: float | None, in_use: int,
                transient: int) -> int:
    """How many layers keep activations on the GPU: floor((budget - in_use - transient) / per_layer).

    ``transient`` is what a step needs besides kept activations (one layer recomputed, the loss
    chunk, dequantised weights, gradients). Clamped to [0, n_layers]; 0 when there is no budget.
    """
    if budget_bytes is None or per_layer <= 0:
        return 0
    free = budget_bytes - in_use - transient
    return max(0, min(n_layers, int(free // per_layer)))
