"""Pinned host blocks for offloaded activations, reused across steps whose shapes differ.

Real SFT data has rows of every length, so each micro-batch has its own shape (padded to its
longest row, or all rows flattened for padding-free batches). A pool keyed by exact shape
allocated fresh pinned memory (``cudaHostAlloc``: slow, and never returned) for almost every step:
the worker's SFT job on 1,000 real rows ran at ~470 tokens/s on an H200 (call s17-c4).

:class:`PinnedPool` keeps free blocks (flat uint8) sorted by size and hands out the smallest free
block that holds a request (best fit), so a shorter batch reuses a longer one's blocks and new
memory is allocated only when a batch needs more than any free block holds. A request of up to
``CHUNK`` bytes takes one block, the request rounded up to a power of two (at least ``ROUND``
bytes): torch's pinned allocator rounds every ``pin_memory`` allocation so
(``CachingHostAllocator``), so that is what the host really gives, and the pool counts it
(``pinned_bytes``) and lets requests use all of it. A larger request takes ceil(n / CHUNK) blocks of
``CHUNK`` bytes (its tensor is copied in CHUNK pieces): at most one chunk of rounding instead of up
to twice the bytes, and a batch longer than any before allocates only the chunks it lacks, not a
whole new set of blocks of the next power of two (padding-free steps of 1.4K, 2.5K, then 4.9K
tokens pinned 1, 2, then 4 GiB of new blocks at ~2.5 GB/s, 0.9-1.6 s a step, call s24-c2). :meth:`trim` (at
each forward's start) frees the smallest blocks beyond the most that were ever in use at once, so
the pool stays about one chain of the largest batch seen; :meth:`release` frees free blocks until
a new one fits under a host budget. Freed blocks go back to the operating system (torch's pinned
cache is emptied), not to a second cache. A block comes back with the event of its last
host-to-device copy; the caller waits for it before writing the block again.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch

ROUND = 1 << 20  # 1 MiB
CHUNK = 8 << 20  # 8 MiB: the largest block; larger requests take several


def pinned_bytes(n: int) -> torch.Tensor:
    """A pinned host uint8 tensor of n bytes."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


def block_bytes(n: int) -> int:
    """The pinned bytes an n-byte request takes: n rounded up to a power of two (>= ROUND) up to
    CHUNK, else to a multiple of CHUNK (that many CHUNK blocks)."""
    if n > CHUNK:
        return -(-n // CHUNK) * CHUNK
    return max(ROUND, 1 << max(0, n - 1).bit_length())


def pieces(n: int) -> list:
    """[(start, end)) byte ranges of an n-byte request, one per block it takes (see block_bytes)."""
    if n <= CHUNK:
        return [(0, n)]
    return [(a, min(n, a + CHUNK)) for a in range(0, n, CHUNK)]


def empty_host_cache() -> None:
    """Return torch's cached free pinned blocks to the operating system (CUDA builds only)."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None and torch.cuda.is_available():
        fn()


class PinnedPool:
    """Best-fit pool of host blocks. ``alloc(n)`` makes a uint8 tensor of n bytes (pinned by
    default; tests pass a plain one). Counters: ``allocs`` (blocks made), ``in_use``,
    ``max_in_use``, ``pooled_bytes`` (free blocks' bytes), ``pinned_bytes`` (all blocks' bytes,
    free and in use) and ``peak_pinned_bytes``."""

    def __init__(self, alloc: Callable[[int], torch.Tensor] = pinned_bytes):
        self.alloc = alloc
        self._sizes: list[int] = []  # ascending, parallel to _free
        self._free: list[tuple[torch.Tensor, object]] = []
        self.allocs = self.in_use = self.max_in_use = self.pooled_bytes = 0
        self.pinned_bytes = self.peak_pinned_bytes = 0

    def fits(self, n: int) -> bool:
        """Free blocks hold an n-byte request (``take`` of n bytes allocates nothing)."""
        if n <= CHUNK:
            return bool(self._sizes) and self._sizes[-1] >= n
        k = len(pieces(n))
        return len(self._sizes) >= k and self._sizes[-k] >= CHUNK

    def take_pieces(self, nbytes: int) -> list:
        """[(block, event of its last H2D copy or None)] for an nbytes request, one per
        :func:`pieces` range (block i holds bytes pieces(nbytes)[i])."""
        if nbytes <= CHUNK:
            return [self._take_block(nbytes)]
        return [self._take_block(CHUNK) for _ in pieces(nbytes)]  # interchangeable CHUNK blocks

    def _take_block(self, n: int) -> tuple:
        """The smallest free block of >= n bytes (n <= CHUNK), or a new one of block_bytes(n)."""
        i = bisect.bisect_left(self._sizes, n)
        if i < len(self._sizes):
            self._sizes.pop(i)
            block, event = self._free.pop(i)
            self.pooled_bytes -= block.numel()
        else:
            block, event = self.alloc(block_bytes(n)), None
            self.allocs += 1
            self.pinned_bytes += block.numel()
            self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)
        self.in_use += 1
        self.max_in_use = max(self.max_in_use, self.in_use)
        return block, event

    def give(self, block: torch.Tensor, event) -> None:
        """Return a block (``event``: its last H2D copy, or None); ``give_all`` returns a
        request's blocks."""
        i = bisect.bisect_left(self._sizes, block.numel())
        self._sizes.insert(i, block.numel())
        self._free.insert(i, (block, event))
        self.pooled_bytes += block.numel()
        self.in_use -= 1

    def give_all(self, blocks, event) -> None:
        for b in blocks:
            self.give(b, event)

    def trim(self) -> None:
        """Free the smallest free blocks while more blocks exist than were ever in use at once."""
        freed = False
        while self._free and self.in_use + len(self._free) > self.max_in_use:
            self._drop(0)
            freed = True
        if freed:
            empty_host_cache()

    def release(self, nbytes: int) -> int:
        """Free free blocks, largest first, until at least ``nbytes`` are freed or none is left
        (waiting for each one's last H2D copy); returns the bytes freed."""
        freed = 0
        while self._free and freed < nbytes:
            event = self._free[-1][1]
            if event is not None:
                event.synchronize()
            freed += self._drop(len(self._free) - 1)
        if freed:
            empty_host_cache()
        return freed

    def _drop(self, i: int) -> int:
        self._sizes.pop(i)
        n = self._free.pop(i)[0].numel()
        self.pooled_bytes -= n
        self.pinned_bytes -= n
        return n
