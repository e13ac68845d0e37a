"""How much of a padded run's compute would go to pad tokens (a line for the run log).

Padded micro-batches (``padding_free=False``, no ``packing``) are padded to their longest row. On
real data (rows of 20 to 4,000 tokens) most of a batch can be padding: 1,000 rows of
``../shared/data/sft`` (Llama-3.1-8B shape, QLoRA, batch 8, max_seq_length 2048, H200) trained at
2,292 real tokens/s padded (call s17-c5) and 7,161 padding-free (s18-c1), the same rows per step.
So ``padding_free`` is the default and the run log says what it saves; a padded run is told what
it spends.
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


def batching_note(lengths: Sequence[int], spec) -> tuple[str, str] | None:
    """(run-log line, level) on how the run batches its rows, or None for packing and for padded
    runs that would waste under a fifth of their compute. ``lengths``: tokens per training row;
    ``spec``: the TrainSpec (packing, padding_free, per_device_train_batch_size,
    gradient_accumulation_steps, seed). Rows are joined per micro-batch
    (per_device_train_batch_size rows), not per optimizer step."""
    if spec.packing:
        return None
    bs = spec.per_device_train_batch_size
    share = padding_share(lengths, bs, spec.seed)
    if spec.padding_free:
        saved = (f"; padded batches would have spent about {share:.0%} of their compute on pad "
                 f"tokens" if share >= 0.01 else "")
        ga = spec.gradient_accumulation_steps
        accum = (f" ({ga} micro-batches, {bs * ga} rows, accumulate into each optimizer step)"
                 if ga > 1 else "")
        return (f"padding-free batches (the default): each micro-batch's {bs} row"
                f"{'s go' if bs != 1 else ' goes'} into one sequence with no pad tokens, "
                f"attention kept inside each row{accum}{saved}", "info")
    if share < 0.2:
        return None
    return (f"about {share:.0%} of the tokens each step computes will be padding (micro-batches of "
            f"{bs} rows padded to their longest row); padding_free (the default: the same rows "
            f"per step, no pad tokens) or packing trains on the real tokens only", "warning")
