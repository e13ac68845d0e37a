"""Pinned host blocks for offloaded activations, reused across steps whose shapes differ.

Real SFT data has rows of every length, so each micro-batch has its own shape (padded to its
longest row, or all rows flattened for padding-free batches). A pool keyed by exact shape
allocated fresh pinned memory (``cudaHostAlloc``: slow, and never returned) for almost every step:
the worker's SFT job on 1,000 real rows ran at ~470 tokens/s on an H200 (call s17-c4).

:class:`PinnedPool` keeps free blocks (flat uint8) sorted by size and hands out the smallest free
block that holds a request (best fit), so a shorter batch reuses a longer one's blocks and new
memory is allocated only when a batch needs more than any free block holds. Blocks are allocated
at the request's size rounded up to ``ROUND`` bytes. :meth:`trim` (at each forward's start) frees
the smallest blocks beyond the most that were ever in use at once, so the pool stays about one
chain of the largest batch seen. A block comes back with the event of its last host-to-device
copy; the caller waits for it before writing the block again.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch

ROUND = 1 << 20  # 1 MiB


def pinned_bytes(n: int) -> torch.Tensor:
    """A pinned host uint8 tensor of n bytes."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Best-fit pool of host blocks. ``alloc(n)`` makes a uint8 tensor of n bytes (pinned by
    default; tests pass a plain one). Counters: ``allocs`` (blocks made), ``in_use``,
    ``max_in_use``, ``pooled_bytes`` (free blocks' bytes)."""

    def __init__(self, alloc: Callable[[int], torch.Tensor] = pinned_bytes):
        self.alloc = alloc
        self._sizes: list[int] = []  # ascending, parallel to _free
        self._free: list[tuple[torch.Tensor, object]] = []
        self.allocs = self.in_use = self.max_in_use = self.pooled_bytes = 0

    def take(self, dtype: torch.dtype, shape) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(view of ``shape`` and ``dtype`` at the start of a block, the block, the event of the
        block's last H2D copy or None)."""
        n = torch.Size(shape).numel() * dtype.itemsize
        i = bisect.bisect_left(self._sizes, n)
        if i < len(self._sizes):
            self._sizes.pop(i)
            block, event = self._free.pop(i)
            self.pooled_bytes -= block.numel()
        else:
            block, event = self.alloc(max(ROUND, -(-n // ROUND) * ROUND)), None
            self.allocs += 1
        self.in_use += 1
        self.max_in_use = max(self.max_in_use, self.in_use)
        return block[:n].view(dtype).view(shape), block, event

    def give(self, block: torch.Tensor, event) -> None:
        """Return a block (``event``: its last H2D copy, or None)."""
        i = bisect.bisect_left(self._sizes, block.numel())
        self._sizes.insert(i, block.numel())
        self._free.insert(i, (block, event))
        self.pooled_bytes += block.numel()
        self.in_use -= 1

    def trim(self) -> None:
        """Free the smallest free blocks while more blocks exist than were ever in use at once."""
        while self._free and self.in_use + len(self._free) > self.max_in_use:
            self._sizes.pop(0)
            self.pooled_bytes -= self._free.pop(0)[0].numel()
