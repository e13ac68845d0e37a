"""worker.engine.lora_casts: the persistent, batch-refreshed LoRA casts equal make_casts bit for
bit, follow every weight update, cast a group the last forward did not use on its own, drop groups
no longer used, and refresh the rest in a few multi-tensor launches."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.engine.lora_casts import CastCache, CastPlan, make_casts
from worker.engine.lora_ops import Proj


def _group(out_sizes, scales, r=4, d_in=24, seed=0):
    """(projs, pairs) of one group: fp32 A [r, d_in], B [out, r]; scale None = no LoRA."""
    g = torch.Generator().manual_seed(seed)
    projs, pairs = [], []
    for out, s in zip(out_sizes, scales):
        projs.append(Proj(nn.Linear(d_in, out, bias=False), None, s or 0.0, s is not None))
        if s is None:
            pairs.append((None, None))
        else:
            pairs.append((nn.Parameter(torch.randn(r, d_in, generator=g)),
                          nn.Parameter(torch.randn(out, r, generator=g))))
    return tuple(projs), pairs


def _same(a, b):
    assert (a.A is None) == (b.A is None) and a.ranks == b.ranks
    if a.A is not None:
        assert a.A.dtype == b.A.dtype and torch.equal(a.A, b.A)
    for x, y in zip(a.Bs, b.Bs, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y)


def _update(pairs, k):
    with torch.no_grad():
        for A, B in pairs:
            if A is not None:
                A.mul_(0.9).add_(0.01 * k)
                B.add_(0.37 * k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plan_casts_equal_make_casts_across_updates(dtype, monkeypatch):
    qkv = _group([16, 8, 8], [2.0, 2.0, 2.0], seed=1)
    o = _group([24], [0.7], seed=2)
    gu = _group([40, 40], [1.0, None], seed=3)   # a projection without LoRA in the group
    plan = CastPlan()
    calls = []
    real = torch._foreach_copy_

    def counted(*a, **k):
        calls.append(len(a[0]))
        return real(*a, **k)
    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    for step in range(4):
        calls.clear()
        cache = CastCache(plan)
        for projs, pairs in (qkv, o, gu, qkv):   # asked twice in a forward: one cast
            got = cache.get(projs, pairs, dtype)
            _same(got, make_casts(projs, pairs, dtype))
        if step == 0:   # first forward: each group cast on its own
            assert len(calls) >= 3
        else:           # later forwards: one batch, whatever the number of groups
            assert calls == [5, 4, 1], calls   # A of 5 LoRA projections; scaled B; s=1 B
        for _, pairs in (qkv, o, gu):
            _update(pairs, step + 1)


def test_new_groups_are_cast_alone_and_unused_ones_dropped():
    dtype = torch.bfloat16
    g1, g2, g3 = (_group([8, 8], [2.0, 2.0], seed=s) for s in (1, 2, 3))
    plan = CastPlan()
    uses = [(g1, g2), (g1, g3), (g1,), (g1, g2)]
    for step, used in enumerate(uses):
        cache = CastCache(plan)
        for projs, pairs in used:
            _same(cache.get(projs, pairs, dtype), make_casts(projs, pairs, dtype))
        for _, pairs in (g1, g2, g3):
            _update(pairs, step + 1)
    # the next forward's refresh keeps only what the last one used
    CastCache(plan).get(*g1, dtype)
    assert len(plan._groups) == 2


def test_groups_without_lora_and_no_plan_use_make_casts():
    frozen = _group([8], [None])
    cache = CastCache(CastPlan())
    c = cache.get(*frozen, torch.bfloat16)
    assert c.A is None and c.Bs == [None]
    lora = _group([8], [2.0])
    plain = CastCache()
    _same(plain.get(*lora, torch.bfloat16), make_casts(*lora, torch.bfloat16))
