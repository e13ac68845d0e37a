"""The offloader's host block pool (worker/engine/pinned.py) on the CPU (plain tensors stand in
for pinned ones): batches of changing shapes reuse blocks, new memory is made only when a batch
needs more than any free block holds, and the pool stays about one chain of the largest batch."""
import torch

from worker.engine import checkpointing as ckpt
from worker.engine.pinned import ROUND, PinnedPool, block_bytes


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
    biggest = 4 << 20  # 4 x 1200 x 256 bf16 = 2.34 MiB, in a power-of-two block
    assert pool.pooled_bytes == pool.pinned_bytes == layers * biggest


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


def test_blocks_are_powers_of_two_as_torch_pins_them():
    assert block_bytes(1) == ROUND and block_bytes(ROUND) == ROUND
    assert block_bytes(ROUND + 1) == 2 * ROUND and block_bytes(3 << 20) == 4 << 20
    pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    view, block, _ = pool.take(torch.bfloat16, (3 << 19,))  # 3 MiB
    assert block.numel() == 4 << 20 and pool.pinned_bytes == 4 << 20
    pool.give(block, None)
    assert pool.fits(4 << 20) and not pool.fits((4 << 20) + 1)
    assert pool.take(torch.uint8, (4 << 20,))[1] is block  # the whole block is usable


def test_release_frees_the_largest_free_blocks_first():
    pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    blocks = [pool.take(torch.uint8, (n << 20,))[1] for n in (1, 2, 4, 8)]
    for b in blocks[1:]:
        pool.give(b, None)  # the 1 MiB block stays in use
    assert pool.pinned_bytes == 15 << 20 and pool.peak_pinned_bytes == 15 << 20
    assert pool.release(5 << 20) == 8 << 20  # one block, the largest, was enough
    assert pool.pinned_bytes == 7 << 20 and pool.pooled_bytes == 6 << 20
    assert pool.release(100 << 20) == 6 << 20 and pool.pinned_bytes == 1 << 20
    assert pool.peak_pinned_bytes == 15 << 20


def test_host_budget_plan_lowers_the_stash_to_fit():
    """Llama-3.1-8B shapes (hidden 4096, Q 4096, K/V 1024), 32 checkpointed layers: at 38,912
    tokens Q, K, V, O stashed take 72 GiB of power-of-two pinned blocks (43 GiB of tensors), O
    only 48 GiB, the inputs 32 GiB (s18-c2: the host ran out of memory at that length)."""
    args = (38_912, 4096, 4096, 1024)
    need = {p: 32 * ckpt.stash_bytes(p, *args) for p in ckpt.STASH_ORDER}
    assert need == {"off": 32 << 30, "o": 48 << 30, "qkvo": 72 << 30}
    off = ckpt.Offloader(False, host_budget=None)
    off.enabled = True  # plan() only runs where offloading does (CUDA); the rule is plain math
    assert off.plan(32, *args) == "qkvo"
    for budget, cap in ((80, "qkvo"), (60, "o"), (40, "off"), (10, "off")):
        off.host_budget = budget << 30
        assert off.plan(32, *args) == cap, budget
    assert off.capped("qkvo") == "off" and off.capped("o") == "off"
    off.host_budget = 60 << 30
    off.plan(32, *args)
    assert off.capped("qkvo") == "o" and off.capped("off") == "off"


def test_a_save_past_the_budget_frees_free_blocks_before_it_stays_on_the_gpu():
    off = ckpt.Offloader(False, host_budget=6 << 20)
    off.pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    a = off.pool.take(torch.uint8, (2 << 20,))[1]
    b = off.pool.take(torch.uint8, (2 << 20,))[1]
    assert not off._over_budget(2 << 20)  # 4 + 2 MiB fit
    off.pool.give(b, None)
    assert not off._over_budget(2 << 20)  # served by the free block
    assert not off._over_budget(4 << 20)  # the free 2 MiB block is freed: 2 + 4 fit
    assert off.pool.pinned_bytes == 2 << 20
    assert off._over_budget(8 << 20)  # 2 in use + 8 never fit
    off.pool.give(a, None)
    assert off.host_budget is not None and not off._over_budget(4 << 20)
