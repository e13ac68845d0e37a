"""Dense NF4 weights held for one generation phase (GRPO rollouts), within the VRAM budget.

Decoding runs the model's original forward once per generated token, and every
:class:`~worker.engine.quant.NF4Linear` would dequantise its whole weight on each of those calls
(256 tokens: 256 dequantisations of all 7 x n_layers projections). :func:`dense_generation`
dequantises each NF4 base once on entry (``NF4Linear.cache_dense``: W [out, in] in the original
dtype, bf16 on GPU) and frees them all on exit, before the training pass; the KV cache is HF's.

Memory bound: the cached weights total at most ``limit`` bytes, layer order (whole modules; the
rest keep dequantising per call). :func:`cache_limit` derives it from the run's VRAM budget:

    limit = budget - memory allocated now - reserve        (0 when there is no budget)

``reserve`` is what generation needs besides the weights: the KV cache and a step's logits
(:func:`generation_reserve`) plus 1 GiB of margin. No budget (``vram_budget_gib`` None) means the
least memory, as for activation checkpointing: nothing is cached. For Llama-3.1-8B in bf16 the
whole cache is 13.0 GiB (6.98 G weights of the 224 projections x 2 bytes).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("worker.engine.gencache")

GIB = 1 << 30


@dataclass
class CacheStats:
    """What one :func:`dense_generation` phase held: modules cached / all NF4 modules, bytes."""

    cached: int = 0
    total: int = 0
    bytes: int = 0
    limit: int = 0


def nf4_modules(model) -> list:
    from worker.engine.quant import NF4Linear

    return [m for m in model.modules() if isinstance(m, NF4Linear)]


def generation_reserve(config, rows: int, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of HF's KV cache for ``rows`` sequences of ``tokens`` plus one step's fp32 logits
    over the vocabulary for every row, plus 1 GiB of margin."""
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    kv_bytes = 2 * config.num_hidden_layers * rows * tokens * kv * hd * dtype_bytes
    return kv_bytes + 2 * rows * config.vocab_size * 4 + GIB


def cache_limit(vram_budget_gib: float | None, reserve: int = GIB) -> int:
    """Bytes the generation cache may take under the budget (see the module docstring)."""
    if vram_budget_gib is None:
        return 0
    in_use = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    return max(0, int(vram_budget_gib * GIB) - in_use - reserve)


@contextlib.contextmanager
def dense_generation(model, vram_budget_gib: float | None = None, *, limit: int | None = None,
                     reserve: int = GIB, on_log=None):
    """Within the block, NF4 bases of ``model`` keep a dense copy (at most ``limit`` bytes, else
    :func:`cache_limit` of the budget); all copies are dropped on exit, even on error.
    Yields :class:`CacheStats`."""
    mods = nf4_modules(model)
    limit = cache_limit(vram_budget_gib, reserve) if limit is None else int(limit)
    stats = CacheStats(total=len(mods), limit=limit)
    try:
        for m in mods:
            need = m.dense_bytes()
            if stats.bytes + need > limit:
                break
            stats.bytes += m.cache_dense()
            stats.cached += 1
        if mods:
            (on_log or log.debug)(
                f"generation: {stats.cached}/{stats.total} NF4 weights held dense "
                f"({stats.bytes / GIB:.2f} GiB of a {limit / GIB:.2f} GiB limit)")
        yield stats
    finally:
        for m in mods:
            m.drop_dense()
