"""The LoRA weights in the compute dtype, made once per model forward.

The fused LoRA functions (:mod:`worker.engine.lora_ops`) read, for each projection group (q/k/v,
o, gate/up, down), A = [A_1; ...; A_N] [sum r, in] and s_p B_p [out_p, r_p] in the compute dtype
(bf16 on the GPU) while the trainable A, B are fp32 master weights. :class:`CastCache` holds them
for one forward, its checkpointed recompute and its backward (the weights cannot change between a
forward and its backward).

Made group by group that is 14 small cast / scale launches a Llama layer, ~450 a step of an 8B
model, each a few tens of microseconds of host time in a step the host bounds (bench/RESULTS.md,
session 26). :class:`CastPlan` (one per model) keeps the casts in buffers that live across
forwards and refreshes every group the last forward used in a few multi-tensor launches at the
first use of a new forward: ``torch._foreach_mul`` (s_p B_p in fp32, rounded once as
``(B * s).to(dtype)`` is) and ``torch._foreach_copy_`` (the casts). A group the last forward did not
use is cast on its own when first asked for (then batched from the next forward on); groups a
forward no longer uses (another adapter, a disabled one) are dropped at the next refresh. Values
are bit-identical to :func:`make_casts`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class Casts:
    """One projection group's LoRA weights in the compute dtype: ``A`` [sum r, in] = [A_1; ...]
    and ``Bs[p]`` = s_p B_p [out_p, r_p] (None for a projection without LoRA); ``ranks`` [r_p]."""

    A: torch.Tensor | None
    Bs: list
    ranks: list


def make_casts(projs, pairs, dtype) -> Casts:
    """:class:`Casts` of ``projs`` (their (A, B) ``pairs``) in ``dtype``; a fp32 weight in fp32 is
    used as is (no copy)."""
    As = [A.to(dtype) for p, (A, _) in zip(projs, pairs) if p.has_lora]
    Bs = [None if not p.has_lora else (B * p.scale if p.scale != 1.0 else B).to(dtype)
          for p, (_, B) in zip(projs, pairs)]
    A = (torch.cat(As) if len(As) > 1 else As[0]) if As else None
    return Casts(A, Bs, [a.shape[0] for a in As])


def _key(projs, pairs, dtype):
    return (dtype, tuple(id(p.base) for p in projs), tuple(id(A) for A, _ in pairs))


class _Group:
    """A group's persistent :class:`Casts` and the sources / destinations of its refresh (a
    group with at least one LoRA projection: :class:`CastCache` casts the others itself)."""

    def __init__(self, projs, pairs, dtype):
        lora = [(p, A, B) for p, (A, B) in zip(projs, pairs) if p.has_lora]
        ranks = [A.shape[0] for _, A, _ in lora]
        A_all = torch.empty(sum(ranks), lora[0][1].shape[1], dtype=dtype, device=lora[0][1].device)
        self.dst_a = list(A_all.split(ranks))
        self.src_a = [A for _, A, _ in lora]
        Bs, it = [], iter(lora)
        self.src_b, self.dst_b, self.scales = [], [], []
        for p in projs:
            if not p.has_lora:
                Bs.append(None)
                continue
            _, _, B = next(it)
            d = torch.empty(B.shape, dtype=dtype, device=B.device)
            Bs.append(d)
            self.src_b.append(B)
            self.dst_b.append(d)
            self.scales.append(p.scale)
        self.casts = Casts(A_all, Bs, ranks)
        self.batch = _batch(self.src_a, self.dst_a, self.src_b, self.dst_b, self.scales)

    def refresh(self):
        """Cast this group alone (a group the last forward did not use)."""
        _refresh(self.batch)


def _batch(src_a, dst_a, src_b, dst_b, scales):
    """The lists :func:`_refresh` launches on: (dst_a, src_a, scaled B sources, their scales and
    destinations, unscaled B sources and destinations)."""
    sc = [i for i, s in enumerate(scales) if s != 1.0]
    pl = [i for i, s in enumerate(scales) if s == 1.0]
    return (dst_a, src_a, [src_b[i] for i in sc], [scales[i] for i in sc], [dst_b[i] for i in sc],
            [src_b[i] for i in pl], [dst_b[i] for i in pl])


def _refresh(batch):
    """dst_a[i] = src_a[i] and dst_b[i] = scale_i * src_b[i] in the destinations' dtype, in a few
    multi-tensor launches (scaled in the sources' dtype, then rounded once, as make_casts does)."""
    dst_a, src_a, src_s, scales, dst_s, src_p, dst_p = batch
    with torch.no_grad():
        if dst_a:
            torch._foreach_copy_(dst_a, src_a)
        if dst_s:
            torch._foreach_copy_(dst_s, torch._foreach_mul(src_s, scales))
        if dst_p:
            torch._foreach_copy_(dst_p, src_p)


class CastPlan:
    """One model's persistent LoRA casts (module docstring); :class:`CastCache` uses it."""

    def __init__(self):
        self._groups: dict = {}     # key -> _Group
        self._live: dict = {}       # keys the current forward used, in order (values unused)
        self._fresh: set = set()    # keys refreshed for the current forward
        self._batch = None          # (keys, lists for _refresh) of the last batch

    def begin(self):
        """A new forward: drop the groups the last one did not use, refresh the rest in one batch."""
        live = self._live
        self._groups = {k: self._groups[k] for k in live if k in self._groups}
        keys = tuple(live)
        if self._batch is None or self._batch[0] != keys:
            gs = [self._groups[k] for k in keys]
            self._batch = (keys, _batch(*([x for g in gs for x in getattr(g, name)] for name in (
                "src_a", "dst_a", "src_b", "dst_b", "scales"))))
        _refresh(self._batch[1])
        self._fresh = set(keys)
        self._live = {}

    def get(self, projs, pairs, dtype) -> Casts:
        key = _key(projs, pairs, dtype)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(projs, pairs, dtype)
            g.refresh()
            self._fresh.add(key)
        elif key not in self._fresh:
            g.refresh()
            self._fresh.add(key)
        self._live[key] = None
        return g.casts


class CastCache:
    """Compute-dtype :class:`Casts` of each projection group, made once per model forward.

    One instance lives in the forward's :class:`~worker.engine.patch.StepInputs`, so a layer's
    forward, its checkpointed recompute and its backward share one copy (the weights cannot change
    between a forward and its backward); the next forward starts a new cache after the optimizer
    step. With the model's :class:`CastPlan` the casts live in its persistent buffers, refreshed
    in one batch at this cache's first use; without one each group is cast on first use.
    Memory: the LoRA weights once in the compute dtype (84 MB for Llama-8B r=16, bf16).
    """

    def __init__(self, plan: CastPlan | None = None):
        self._d: dict = {}
        self._plan = plan
        self._begun = False

    def get(self, projs, pairs, dtype) -> Casts:
        key = _key(projs, pairs, dtype)
        c = self._d.get(key)
        if c is None:
            if self._plan is None or not any(p.has_lora for p in projs):
                c = make_casts(projs, pairs, dtype)
            else:
                if not self._begun:
                    self._plan.begin()
                    self._begun = True
                c = self._plan.get(projs, pairs, dtype)
            self._d[key] = c
        return c
