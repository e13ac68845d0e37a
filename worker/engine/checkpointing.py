"""Per-decoder-layer activation checkpointing, offloaded to pinned CPU memory, under a VRAM budget.

:func:`checkpoint_layer` runs ``fn(h)`` (one decoder layer, h [B, S, H]) without keeping its
activations: forward runs under ``no_grad`` and saves only the layer input h; backward recomputes the
layer with grad enabled and back-propagates through it (reentrant style: the LoRA parameters' .grad
are accumulated by that inner backward, dh is returned). The RNG state is restored for the recompute
when ``preserve_rng`` (dropout).

Offload (:class:`Offloader`, CUDA only; elsewhere the input stays where it is and nothing changes):
forward copies h to a pinned host buffer on a D2H side stream (``non_blocking``; the GPU copy is
released once the copy is done via ``record_stream``). Buffers come from a free list per
(layer, shape, dtype), reused across steps. Backward copies h back on a separate H2D side stream and
prefetches: the checkpointed layers of one forward form a chain (:meth:`Offloader.start_chain`, then
one ``save`` per layer in order), and the backward of layer i, which loads its own input, also starts
the H2D copy of layer i-1's (the next one backward reaches), so that copy (B*S*H elements:
2 x 2048 x 4096 bf16 = 32 MiB, ~0.6 ms over PCIe) overlaps layer i's recompute and backward instead
of stalling the compute stream. :meth:`Offloader.prefetch_last` (after the forward's last layer)
starts the first one, so every load of a backward can be a prefetch; one extra layer input is live
on the GPU at a time. Ordering is by events: the H2D stream waits for the buffer's D2H; the compute
stream waits for the H2D before using the tensor (allocated on the H2D stream, then
``record_stream``-ed on the compute stream so the caching allocator cannot hand it out early); the
buffer goes back to its free list with its H2D event, which the next save into it (step N+1's
forward) waits for on the D2H stream. A buffer is in one handle at a time, so two forwards before
one backward get two buffers.

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
import weakref

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


class _Saved:
    """One saved layer input: ``dev`` (kept as is), or a pinned ``buf`` with its D2H event, the
    H2D copy once started (``copy``, ``h2d`` event) and a weak link to the previous layer's handle."""

    __slots__ = ("dev", "buf", "key", "d2h", "device", "prev", "copy", "h2d", "__weakref__")

    def __init__(self, dev=None, buf=None, key=None, d2h=None, device=None, prev=None):
        self.dev, self.buf, self.key, self.d2h = dev, buf, key, d2h
        self.device, self.prev, self.copy, self.h2d = device, prev, None, None


class Offloader:
    """Pinned host buffers (a free list per (layer, shape, dtype)), a D2H and an H2D side stream."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and torch.cuda.is_available()
        self.free: dict = {}  # key -> [(pinned buffer, event of its last H2D or None)]
        self.stream = torch.cuda.Stream() if self.enabled else None  # D2H
        self.h2d = torch.cuda.Stream() if self.enabled else None
        self._last = None  # weakref to the last handle saved in the current chain
        self.prefetches = 0  # loads served by a copy started ahead (by the next layer's backward)

    def start_chain(self):
        """The next ``save`` starts a new forward's chain (no prefetch link to an older one)."""
        self._last = None

    def save(self, key, h: torch.Tensor) -> _Saved:
        """Returns a handle; with offloading the GPU tensor may be freed by the caller at once."""
        if not (self.enabled and h.is_cuda):
            return _Saved(dev=h)
        k = (key, tuple(h.shape), h.dtype)
        pool = self.free.setdefault(k, [])
        if pool:
            buf, last_h2d = pool.pop()
        else:
            buf, last_h2d = torch.empty(h.shape, dtype=h.dtype, pin_memory=True), None
        self.stream.wait_stream(torch.cuda.current_stream())
        if last_h2d is not None:  # the previous H2D out of this buffer must have read it
            self.stream.wait_event(last_h2d)
        with torch.cuda.stream(self.stream):
            buf.copy_(h, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        h.record_stream(self.stream)
        hd = _Saved(buf=buf, key=k, d2h=ev, device=h.device, prev=self._last)
        self._last = weakref.ref(hd)
        return hd

    def prefetch_last(self):
        """Start the H2D copy of the chain's last input (the first that backward loads), so that it
        overlaps what runs between the forward and that backward (final norm, LM head, loss)."""
        last = self._last() if self._last is not None else None
        if last is not None:
            self._start_h2d(last)

    def _start_h2d(self, hd: _Saved):
        """Queue hd's host->device copy on the H2D stream (once); the buffer returns to its pool."""
        if hd.buf is None:
            return
        self.h2d.wait_event(hd.d2h)
        with torch.cuda.stream(self.h2d):
            hd.copy = hd.buf.to(hd.device, non_blocking=True)
            hd.h2d = torch.cuda.Event()
            hd.h2d.record()
        self.free[hd.key].append((hd.buf, hd.h2d))
        hd.buf = None

    def load(self, hd: _Saved) -> torch.Tensor:
        """The saved tensor on its device, ready on the current stream; prefetches the previous
        layer's input (see the module docstring). Each handle is loaded once."""
        if hd.dev is not None:
            return hd.dev
        if hd.buf is None:
            self.prefetches += 1
        self._start_h2d(hd)
        prev = hd.prev() if hd.prev is not None else None
        if prev is not None:
            self._start_h2d(prev)
        cur = torch.cuda.current_stream()
        cur.wait_event(hd.h2d)
        t = hd.copy
        t.record_stream(cur)
        hd.copy = hd.h2d = hd.prev = None
        return t


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
        ctx.offloader, ctx.handle = offloader, offloader.save(key, h.detach())
        return out

    @staticmethod
    def backward(ctx, dout):
        h = ctx.offloader.load(ctx.handle).detach().requires_grad_(True)
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
