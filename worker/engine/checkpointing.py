"""Activation checkpointing per layer segment, offloaded to pinned CPU memory, under a VRAM budget.

:func:`checkpoint_layer` runs ``fn(h)`` (one segment of a decoder layer: its attention block or its
MLP block, h [B, S, H]) without keeping its activations: forward runs under ``no_grad`` and saves
the segment input h (and what the segment stashes, below); backward recomputes the segment with grad
enabled and back-propagates through it (reentrant style: the LoRA parameters' .grad are accumulated
by that inner backward, dh is returned). The RNG state is restored for the recompute when
``preserve_rng`` (dropout).

Stash: while the segment's forward runs, :func:`stash_mode` is ("record", its :class:`Stash`); an op
may leave tensors there that its backward needs and whose recompute is costly
(:class:`~worker.engine.attention.SDPAFunction` leaves the attention output, its logsumexp and
Q, K, V). In the recompute the mode is ("replay", the same stash) and the op takes them back instead
of computing. Stashed tensors are offloaded like the input.

Offload (:class:`Offloader`, CUDA only; elsewhere tensors stay where they are and nothing changes):
forward copies each saved tensor to a pinned host buffer on a D2H side stream (``non_blocking``; the
GPU copy is released once the copy is done via ``record_stream``; a permuted dense tensor travels in
its memory order). Buffers are blocks of a best-fit :class:`~worker.engine.pinned.PinnedPool`, reused
across steps whatever their shapes; a tensor of more than ``pinned.CHUNK`` bytes is copied in CHUNK
pieces into as many blocks (one copy each way per piece).
Backward copies them back on a separate H2D side stream and prefetches: the saves of one forward form
a chain (:meth:`Offloader.start_chain`, then every ``save`` in order), and each load also starts the
H2D copies of the saves before it (what backward reaches next) until ``window`` bytes are in flight,
one layer's worth (its two segment inputs and stash: 144 MiB for Llama-8B at 4096 tokens with
Q, K, V, O stashed), so the copies (~55 GB/s over PCIe) overlap the recompute and backward instead
of stalling the compute stream. :meth:`Offloader.prefetch_last` (after the forward's last layer)
starts the first ones. Ordering is by events: the H2D stream waits for the buffer's D2H; the compute
stream waits for the H2D before using the tensor (allocated on the H2D stream, then
``record_stream``-ed on the compute stream so the caching allocator cannot hand it out early); the
buffer goes back to its free list with its H2D event, which the next save into it (step N+1's
forward) waits for on the D2H stream. A buffer is in one handle at a time, so two forwards before
one backward get two buffers.

Recompute skip: while backward recomputes a segment, :func:`recomputing` is true (thread-local: the
autograd worker thread). The value ``fn`` returns then is discarded (only the graph it builds is
back-propagated), so work that feeds *only* that value may be skipped: the attention block's o_proj
and the MLP's down projection (their outputs go straight into ``h + x``), see
:mod:`worker.engine.patch` and :mod:`worker.engine.lora_ops`. A ``fn`` that reads the flag must be
one segment whose return is that value (not several chained in one checkpoint).

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

from worker.engine.pinned import PinnedPool, block_bytes, pieces

_local = threading.local()


def recomputing() -> bool:
    """True while a checkpointed layer is recomputed in backward (its returned value is unused)."""
    return getattr(_local, "recompute", False)


def stash_mode():
    """("record" | "replay" | None, :class:`Stash` or None) of the checkpointed segment running on
    this thread: "record" in its forward, "replay" in its recompute (see the module docstring)."""
    return getattr(_local, "stash", (None, None))


@contextlib.contextmanager
def _stashing(mode, stash):
    prev = stash_mode()
    _local.stash = (mode, stash)
    try:
        yield
    finally:
        _local.stash = prev


@contextlib.contextmanager
def _recompute():
    prev = recomputing()
    _local.recompute = True
    try:
        yield
    finally:
        _local.recompute = prev


class _Saved:
    """One saved tensor: ``dev`` (kept as is), or pinned ``blocks`` (one per :func:`pieces` range
    of its bytes) with their D2H event, its ``shape``/``dtype`` (in memory order), the H2D copy
    once started (``copy``, ``h2d`` event), a weak link to the handle saved before it, its size
    and the permutation that restores a non-contiguous tensor's layout (``perm``)."""

    __slots__ = ("dev", "blocks", "shape", "dtype", "d2h", "device", "prev", "copy", "h2d",
                 "nbytes", "perm", "__weakref__")

    def __init__(self, dev=None, blocks=None, shape=None, dtype=None, d2h=None, device=None,
                 prev=None, perm=None):
        self.dev, self.blocks, self.shape, self.dtype, self.d2h = dev, blocks, shape, dtype, d2h
        self.device, self.prev, self.copy, self.h2d = device, prev, None, None
        self.nbytes = shape.numel() * dtype.itemsize if blocks is not None else 0
        self.perm = perm


class Stash:
    """What a checkpointed segment's forward leaves for its recompute besides its input.

    :meth:`put` offloads tensors through the segment's :class:`Offloader` (they join the prefetch
    chain in save order) and keeps small ones (``keep``) where they are; :meth:`take` returns them
    all once, on the device, in the order given. ``qkv``: the attention stashed Q, K, V too.
    """

    __slots__ = ("offloader", "key", "handles", "keep", "qkv")

    def __init__(self, offloader: "Offloader", key):
        self.offloader, self.key = offloader, key
        self.handles, self.keep, self.qkv = [], (), False

    def put(self, *tensors, keep=()):
        self.handles = [self.offloader.save(self.key, t) for t in tensors]
        self.keep = tuple(keep)

    def pending(self) -> bool:
        return bool(self.handles) or bool(self.keep)

    def take(self) -> list:
        out = [self.offloader.load(h) for h in self.handles] + list(self.keep)
        self.handles, self.keep = [], ()
        return out


def _dense_order(t: torch.Tensor):
    """(t as a contiguous permutation of itself, the permutation back) or (t.contiguous(), None)."""
    if t.is_contiguous():
        return t, None
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    base = t.permute(order)
    if not base.is_contiguous():
        return t.contiguous(), None
    back = [0] * t.dim()
    for i, d in enumerate(order):
        back[d] = i
    return base, back


STASH_ORDER = ("off", "o", "qkvo")  # what an attention segment stashes, least to most


def stash_bytes(policy: str, tokens: int, hidden: int, q_dim: int, kv_dim: int,
                dtype_bytes: int = 2) -> int:
    """Host bytes one checkpointed layer's offloaded saves take under a stash ``policy``: its two
    segment inputs [tokens, hidden], plus O [tokens, q_dim] ("o"), plus Q, K, V ("qkvo"), each in
    its own pool blocks (:func:`~worker.engine.pinned.block_bytes`)."""
    def blk(width):
        return block_bytes(tokens * width * dtype_bytes)
    n = 2 * blk(hidden)
    if policy in ("o", "qkvo"):
        n += blk(q_dim)
    if policy == "qkvo":
        n += blk(q_dim) + 2 * blk(kv_dim)
    return n


class Offloader:
    """Pinned host buffers (:class:`~worker.engine.pinned.PinnedPool`), a D2H and an H2D side
    stream. ``pool.allocs`` counts the blocks allocated.

    ``window``: bytes of H2D copies kept in flight ahead of the backward (set per chain to one
    layer's worth of saves: its two segments' inputs and stash).

    ``host_budget``: bytes of pinned host memory the pool may hold (None: no limit). Each chain
    first lowers what attention stashes (:meth:`plan`, ``stash_cap``: "qkvo" -> "o" -> "off",
    attention then recomputed in backward) until the chain fits; a save that still would pass
    the budget frees free blocks, and if it still does not fit its tensor stays on the GPU
    (``on_device``/``on_device_bytes`` count those; ``on_log`` hears of it once), so a long
    sequence uses GPU memory instead of taking the host's last memory (on a shared box the
    kernel's OOM killer ends whatever process it picks).
    """

    def __init__(self, enabled: bool, host_budget: int | None = None,
                 on_log=None):
        self.enabled = enabled and torch.cuda.is_available()
        self.host_budget = host_budget
        self.on_log = on_log
        self.stash_cap = "qkvo"
        self.on_device = self.on_device_bytes = 0
        self._told = False
        self.pool = PinnedPool()
        self.stream = torch.cuda.Stream() if self.enabled else None  # D2H
        self.h2d = torch.cuda.Stream() if self.enabled else None
        self._last = None  # weakref to the last handle saved in the current chain
        self.prefetches = 0  # loads served by a copy started ahead of the load
        self.loads = 0  # loads of offloaded tensors
        self.window = 0
        self.ahead = 0  # bytes of started, not yet loaded H2D copies
        self._chain_bytes = 0
        self._segments = 0

    def start_chain(self):
        """The next ``save`` starts a new forward's chain (no prefetch link to an older one)."""
        self._last = None
        self.ahead = self._chain_bytes = self._segments = 0
        self.pool.trim()

    def plan(self, layers: int, tokens: int, hidden: int, q_dim: int, kv_dim: int) -> str:
        """Set ``stash_cap`` for the next chain: the most a layer's attention may stash so that
        ``layers`` checkpointed layers of ``tokens`` tokens fit the host budget ("off" when even
        the segment inputs do not; the saves then fall back to the GPU)."""
        self.stash_cap = "qkvo"
        if self.enabled and self.host_budget is not None:
            fit = [p for p in STASH_ORDER
                   if layers * stash_bytes(p, tokens, hidden, q_dim, kv_dim) <= self.host_budget]
            self.stash_cap = fit[-1] if fit else "off"
        return self.stash_cap

    def capped(self, policy: str) -> str:
        """``policy`` lowered to at most ``stash_cap`` (see :data:`STASH_ORDER`)."""
        return STASH_ORDER[min(STASH_ORDER.index(policy), STASH_ORDER.index(self.stash_cap))]

    def _over_budget(self, nbytes: int) -> bool:
        """A save of nbytes would pass the host budget even after freeing free blocks."""
        if self.host_budget is None or self.pool.fits(nbytes):
            return False
        over = self.pool.pinned_bytes + block_bytes(nbytes) - self.host_budget
        if over > 0:
            self.pool.release(over)
        return self.pool.pinned_bytes + block_bytes(nbytes) > self.host_budget

    def note_segment(self):
        """One more checkpointed segment in this chain (sizes the prefetch window)."""
        self._segments += 1

    def save(self, key, h: torch.Tensor) -> _Saved:
        """Returns a handle; with offloading the GPU tensor may be freed by the caller at once.
        A non-contiguous tensor that is a permutation of a dense one travels in its memory order."""
        if not (self.enabled and h.is_cuda):
            return _Saved(dev=h)
        if self._over_budget(h.numel() * h.element_size()):
            self.on_device += 1
            self.on_device_bytes += h.numel() * h.element_size()
            if not self._told and self.on_log is not None:
                self._told = True
                self.on_log(f"engine: offloaded activations reached the host memory budget "
                            f"({self.host_budget / 2**30:.1f} GiB pinned); the rest stay on the "
                            f"GPU (WHETSTONE_OFFLOAD_HOST_GIB sets the budget)")
            return _Saved(dev=h)
        h, perm = _dense_order(h)
        n = h.numel() * h.element_size()
        got = self.pool.take_pieces(n)
        self.stream.wait_stream(torch.cuda.current_stream())
        waited = set()
        for _, last_h2d in got:  # the previous H2D out of each block must have read it
            if last_h2d is not None and id(last_h2d) not in waited:
                waited.add(id(last_h2d))
                self.stream.wait_event(last_h2d)
        flat = h.reshape(-1).view(torch.uint8)
        with torch.cuda.stream(self.stream):
            for (block, _), (a, b) in zip(got, pieces(n)):
                block[:b - a].copy_(flat[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        h.record_stream(self.stream)
        hd = _Saved(blocks=[block for block, _ in got], shape=h.shape, dtype=h.dtype, d2h=ev,
                    device=h.device, prev=self._last, perm=perm)
        self._last = weakref.ref(hd)
        self._chain_bytes += hd.nbytes
        return hd

    def prefetch_last(self):
        """Start the H2D copies of the chain's last saves (the first that backward loads), so that
        they overlap what runs between the forward and that backward (final norm, LM head, loss)."""
        self.window = 2 * self._chain_bytes // max(1, self._segments)
        last = self._last() if self._last is not None else None
        if last is not None:
            self._start_h2d(last)
            self._prefetch_before(last)

    def _prefetch_before(self, hd: _Saved):
        """Start copies of the saves before hd (what backward loads next) up to ``window`` bytes."""
        p = hd.prev() if hd.prev is not None else None
        while p is not None and self.ahead < self.window:
            self._start_h2d(p)
            p = p.prev() if p.prev is not None else None

    def _start_h2d(self, hd: _Saved):
        """Queue hd's host->device copy on the H2D stream (once); the buffer returns to its pool."""
        if hd.blocks is None:
            return
        self.ahead += hd.nbytes
        self.h2d.wait_event(hd.d2h)
        with torch.cuda.stream(self.h2d):
            hd.copy = torch.empty(hd.shape, dtype=hd.dtype, device=hd.device)
            flat = hd.copy.view(-1).view(torch.uint8)
            for block, (a, b) in zip(hd.blocks, pieces(hd.nbytes)):
                flat[a:b].copy_(block[:b - a], non_blocking=True)
            hd.h2d = torch.cuda.Event()
            hd.h2d.record()
        self.pool.give_all(hd.blocks, hd.h2d)
        hd.blocks = None

    def load(self, hd: _Saved) -> torch.Tensor:
        """The saved tensor on its device, ready on the current stream, in its saved layout; starts
        the copies of the saves before it up to ``window`` bytes (see the module docstring). Each
        handle is loaded once."""
        if hd.dev is not None:
            return hd.dev
        self.loads += 1
        if hd.blocks is None:
            self.prefetches += 1
        self._start_h2d(hd)
        self.ahead -= hd.nbytes
        self._prefetch_before(hd)
        cur = torch.cuda.current_stream()
        cur.wait_event(hd.h2d)
        t = hd.copy
        t.record_stream(cur)
        hd.copy = hd.h2d = hd.prev = None
        return t.permute(hd.perm) if hd.perm is not None else t


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
        stash = Stash(offloader, key)
        with torch.no_grad(), _stashing("record", stash):
            out = fn(h)
        offloader.note_segment()
        ctx.offloader, ctx.handle, ctx.stash = offloader, offloader.save(key, h.detach()), stash
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
                    _recompute(), _stashing("replay", ctx.stash):
                out = ctx.fn(h)
            ctx.stash = None
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
