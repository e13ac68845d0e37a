"""How much of a padded run's compute goes to pad tokens (a hint for the run log).

Without ``packing`` or ``padding_free`` every micro-batch is padded to its longest row. On real
data (rows of 20 to 4,000 tokens) most of a batch can be padding: 1,000 rows of
``../shared/data/sft`` at batch 8 and max_seq_length 2048 trained at 2,292 real tokens/s padded
against 10,709 packed on an H200 (bench/RESULTS.md, call s17-c5).
"""
from __future__ import annotations

import random
from collections.abc import Sequence


def padding_share(lengths: Sequence[int], batch_size: int, seed: int = 0) -> float:
    """Share of the tokens computed in one epoch that are padding, for ``lengths`` (tokens per
    row) shuffled with ``seed`` and cut into micro-batches of ``batch_size`` rows, each padded to
    its longest row (0.0 for no rows or batch_size 1)."""
    if batch_size <= 1 or not lengths:
        return 0.0
    order = list(lengths)
    random.Random(seed).shuffle(order)
    computed = sum(max(order[i:i + batch_size]) * len(order[i:i + batch_size])
                   for i in range(0, len(order), batch_size))
    return 1.0 - sum(order) / computed


def padding_note(lengths: Sequence[int], spec) -> str | None:
    """A run-log line when a padded run (no ``packing``, no ``padding_free``) would spend at
    least a fifth of its compute on padding; None otherwise."""
    if spec.packing or spec.padding_free:
        return None
    share = padding_share(lengths, spec.per_device_train_batch_size, spec.seed)
    if share < 0.2:
        return None
    return (f"about {share:.0%} of the tokens each step computes will be padding (batches of "
            f"{spec.per_device_train_batch_size} rows padded to their longest row); padding_free "
            f"(the same rows per step, no pad tokens) or packing trains on the real tokens only")
