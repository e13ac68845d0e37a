"""The offloader's host block pool (worker/engine/pinned.py) on the CPU (plain tensors stand in
for pinned ones): batches of changing shapes reuse blocks, new memory is made only when a batch
needs more than any free block holds, a request past CHUNK bytes takes CHUNK blocks (a longer
batch adds only the chunks it lacks), and the pool stays about one chain of the largest batch."""
import torch

from worker.engine import checkpointing as ckpt
from worker.engine.pinned import CHUNK, ROUND, PinnedPool, block_bytes, pieces


def _plain_pool():
    return PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))


def _take(pool, nbytes):
    """The blocks of an nbytes request, each filled over its piece (the memory is writable)."""
    got = pool.take_pieces(nbytes)
    assert len(got) == len(pieces(nbytes))
    for (block, _), (a, b) in zip(got, pieces(nbytes)):
        assert block.numel() >= b - a
        block[:b - a].fill_(1)
    return [block for block, _ in got]


def _chain(pool, shapes, dtype=torch.bfloat16):
    """One forward's saves then its backward's returns (events: None)."""
    pool.trim()
    got = [_take(pool, torch.Size(s).numel() * dtype.itemsize) for s in shapes]
    for blocks in reversed(got):
        pool.give_all(blocks, None)
    return [len(b) for b in got]


def test_shorter_batches_reuse_longer_blocks_and_the_pool_stays_one_chain():
    pool = _plain_pool()
    layers = 8
    lengths = [700, 300, 1200, 64, 1200, 900, 1199, 30, 1100, 500] * 3
    allocs = []
    for S in lengths:
        shapes = [(4, S, 256)] * layers
        assert _chain(pool, shapes) == [1] * layers
        allocs.append(pool.allocs)
    # blocks are made when a batch is longer than every earlier one (700, then 1200), never after
    assert allocs[0] == layers and allocs[1] == layers and allocs[2] == 2 * layers
    assert allocs[-1] == 2 * layers
    assert pool.max_in_use == layers and pool.in_use == 0
    pool.trim()  # the 700-token blocks go: one chain of the largest batch is kept
    biggest = 4 << 20  # 4 x 1200 x 256 bf16 = 2.34 MiB, in a power-of-two block
    assert pool.pooled_bytes == pool.pinned_bytes == layers * biggest


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    pool = _plain_pool()
    (small,) = _take(pool, ROUND)
    (big,) = _take(pool, 3 * ROUND)
    pool.give(big, None)
    pool.give(small, None)
    assert _take(pool, 40) == [small]
    assert _take(pool, ROUND + 4) == [big]
    assert pool.allocs == 2
    (block,) = _take(pool, 30)
    assert pool.allocs == 3 and block.numel() == ROUND


def test_blocks_are_powers_of_two_as_torch_pins_them_up_to_a_chunk():
    assert block_bytes(1) == ROUND and block_bytes(ROUND) == ROUND
    assert block_bytes(ROUND + 1) == 2 * ROUND and block_bytes(3 << 20) == 4 << 20
    assert block_bytes(CHUNK) == CHUNK and block_bytes(CHUNK + 1) == 2 * CHUNK
    assert block_bytes(5 * CHUNK - 7) == 5 * CHUNK  # not the 8 a power of two would take
    pool = _plain_pool()
    (block,) = _take(pool, 3 << 20)  # 3 MiB
    assert block.numel() == 4 << 20 and pool.pinned_bytes == 4 << 20
    pool.give(block, None)
    assert pool.fits(4 << 20) and not pool.fits((4 << 20) + 1)
    assert _take(pool, 4 << 20) == [block]  # the whole block is usable


def test_a_longer_batch_adds_only_the_chunks_it_lacks():
    """Saves past CHUNK go in CHUNK pieces: 2.5 then 4.2 chunks' worth pin 3 then 2 more chunks
    (a power of two would have pinned 4, then 8 more)."""
    pool = _plain_pool()
    n1, n2 = 5 * CHUNK // 2, 21 * CHUNK // 5
    assert pieces(n1) == [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, n1)]
    first = _take(pool, n1)
    assert pool.allocs == 3 and pool.pinned_bytes == 3 * CHUNK
    pool.give_all(first, None)
    assert pool.fits(3 * CHUNK) and not pool.fits(3 * CHUNK + 1)
    second = _take(pool, n2)
    assert len(second) == 5 and pool.allocs == 5 and pool.pinned_bytes == 5 * CHUNK
    assert {id(b) for b in first} <= {id(b) for b in second}
    assert all(b.numel() == CHUNK for b in second)
    pool.give_all(second, None)
    assert pool.in_use == 0 and pool.max_in_use == 5


def test_a_request_past_a_chunk_never_takes_a_smaller_block():
    pool = _plain_pool()
    small = _take(pool, 3 << 20)
    pool.give_all(small, None)
    big = _take(pool, CHUNK + 1)
    assert [b.numel() for b in big] == [CHUNK, CHUNK] and pool.allocs == 3
    pool.give_all(big, None)
    assert pool.fits(2 * CHUNK) and not pool.fits(3 * CHUNK)


def test_release_frees_the_largest_free_blocks_first():
    pool = _plain_pool()
    blocks = [_take(pool, n << 20)[0] for n in (1, 2, 4, 8)]
    for b in blocks[1:]:
        pool.give(b, None)  # the 1 MiB block stays in use
    assert pool.pinned_bytes == 15 << 20 and pool.peak_pinned_bytes == 15 << 20
    assert pool.release(5 << 20) == 8 << 20  # one block, the largest, was enough
    assert pool.pinned_bytes == 7 << 20 and pool.pooled_bytes == 6 << 20
    assert pool.release(100 << 20) == 6 << 20 and pool.pinned_bytes == 1 << 20
    assert pool.peak_pinned_bytes == 15 << 20


def test_host_budget_plan_lowers_the_stash_to_fit():
    """Llama-3.1-8B shapes (hidden 4096, Q 4096, K/V 1024), 32 checkpointed layers: at 38,912
    tokens (304 MiB a segment input: 38 chunks; K, V 76 MiB: 10) Q, K, V, O stashed take 43 GiB
    of pinned chunks (power-of-two blocks took 72 GiB: s18-c2's host ran out of memory at that
    length), O only 28.5 GiB, the inputs 19 GiB."""
    args = (38_912, 4096, 4096, 1024)
    need = {p: 32 * ckpt.stash_bytes(p, *args) for p in ckpt.STASH_ORDER}
    assert need == {"off": 19 << 30, "o": 57 << 29, "qkvo": 43 << 30}
    off = ckpt.Offloader(False, host_budget=None)
    off.enabled = True  # plan() only runs where offloading does (CUDA); the rule is plain math
    assert off.plan(32, *args) == "qkvo"
    for budget, cap in ((60, "qkvo"), (40, "o"), (25, "off"), (10, "off")):
        off.host_budget = budget << 30
        assert off.plan(32, *args) == cap, budget
    assert off.capped("qkvo") == "off" and off.capped("o") == "off"
    off.host_budget = 40 << 30
    off.plan(32, *args)
    assert off.capped("qkvo") == "o" and off.capped("off") == "off"


def test_a_save_past_the_budget_frees_free_blocks_before_it_stays_on_the_gpu():
    off = ckpt.Offloader(False, host_budget=6 << 20)
    off.pool = _plain_pool()
    (a,) = _take(off.pool, 2 << 20)
    (b,) = _take(off.pool, 2 << 20)
    assert not off._over_budget(2 << 20)  # 4 + 2 MiB fit
    off.pool.give(b, None)
    assert not off._over_budget(2 << 20)  # served by the free block
    assert not off._over_budget(4 << 20)  # the free 2 MiB block is freed: 2 + 4 fit
    assert off.pool.pinned_bytes == 2 << 20
    assert off._over_budget(8 << 20)  # 2 in use + 8 never fit
    off.pool.give(a, None)
    assert off.host_budget is not None and not off._over_budget(4 << 20)
