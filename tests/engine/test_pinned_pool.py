"""The offloader's host block pool (worker/engine/pinned.py) on the CPU (plain tensors stand in
for pinned ones): batches of changing shapes reuse blocks, new memory is made only when a batch
needs more than any free block holds, and the pool stays about one chain of the largest batch."""
import torch

from worker.engine.pinned import ROUND, PinnedPool


def _chain(pool, shapes, dtype=torch.bfloat16):
    """One forward's saves then its backward's returns (events: None)."""
    pool.trim()
    got = [pool.take(dtype, s) for s in shapes]
    for view, block, _ in got:
        assert view.dtype == dtype and view.data_ptr() == block.data_ptr()
        view.fill_(1)  # the view is writable memory of the block
    for _, block, _ in reversed(got):
        pool.give(block, None)
    return [tuple(v.shape) for v, _, _ in got]


def test_shorter_batches_reuse_longer_blocks_and_the_pool_stays_one_chain():
    pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    layers = 8
    lengths = [700, 300, 1200, 64, 1200, 900, 1199, 30, 1100, 500] * 3
    allocs = []
    for S in lengths:
        shapes = [(4, S, 256)] * layers
        assert _chain(pool, shapes) == shapes
        allocs.append(pool.allocs)
    # blocks are made when a batch is longer than every earlier one (700, then 1200), never after
    assert allocs[0] == layers and allocs[1] == layers and allocs[2] == 2 * layers
    assert allocs[-1] == 2 * layers
    assert pool.max_in_use == layers and pool.in_use == 0
    pool.trim()  # the 700-token blocks go: one chain of the largest batch is kept
    biggest = -(-4 * 1200 * 256 * 2 // ROUND) * ROUND
    assert pool.pooled_bytes == layers * biggest


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    small = pool.take(torch.float32, (ROUND // 4,))[1]
    big = pool.take(torch.float32, (3 * ROUND // 4,))[1]
    pool.give(big, None)
    pool.give(small, None)
    assert pool.take(torch.float32, (10,))[1] is small
    assert pool.take(torch.float32, (ROUND // 4 + 1,))[1] is big
    assert pool.allocs == 2
    view, block, _ = pool.take(torch.bfloat16, (3, 5))
    assert pool.allocs == 3 and block.numel() == ROUND and view.shape == (3, 5)
