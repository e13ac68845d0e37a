"""Where the CPU's time goes in a training step, without a profiler: wall-clock accumulators
wrapped around the engine's functions (about 1 us of overhead per call).

    python3 bench/cpu_split.py qlora 2048 2 [--budget GiB] [--no-offload] [--rows 8] [--cprofile 40]

Same model and step as bench/train_step.py; after 3 warm-up steps, 3 steps are measured. Prints per
step: the forward's and backward's issue time (CPU) and GPU time, and for each wrapped function its
calls and CPU ms (inclusive: nested wrapped functions count in both).

``--rows N``: padding-free steps as the worker's default job runs them: one sequence of N rows of
real-like lengths (bench/warmup_probe.py's lognormal draw, median ~240, clipped to SEQ), positions
restarting at each row; each measured step is a different draw (``seq`` and ``bs`` then only cap a
row's length). ``--cprofile K``: also run the measured steps under cProfile (slower; its times are
relative) and print the K functions with the most own time.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ACC = collections.defaultdict(lambda: [0, 0.0])


def wrap(obj, name, label=None):
    fn = getattr(obj, name)
    label = label or f"{getattr(obj, '__name__', type(obj).__name__)}.{name}"

    @functools.wraps(fn)
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            r = ACC[label]
            r[0] += 1
            r[1] += time.perf_counter() - t0
    setattr(obj, name, timed)


def main(argv=None):
    import torch

    from train_step import build

    ap = argparse.ArgumentParser()
    ap.add_argument("config", choices=["qlora", "lora"])
    ap.add_argument("seq", type=int)
    ap.add_argument("bs", type=int)
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--no-offload", action="store_true")
    ap.add_argument("--rows", type=int, default=0)
    ap.add_argument("--cprofile", type=int, default=0)
    a = ap.parse_args(argv)
    pm = build(a.config, a.budget, not a.no_offload)
    pm.train()

    import importlib

    # import_module: the kernels package re-exports functions named like its modules
    knf4, krms, krope, kglu, cross_entropy = (importlib.import_module(f"whetstone_kernels.{m}") for m in (
        "nf4", "rms_norm", "rope", "swiglu", "cross_entropy"))
    from worker.engine import attention, checkpointing, engine, lora_ops, patch

    wrap(checkpointing.Offloader, "save", "Offloader.save")
    wrap(checkpointing.Offloader, "load", "Offloader.load")
    wrap(checkpointing, "checkpoint_layer")
    wrap(patch, "attn_block")
    wrap(patch, "mlp_block")
    wrap(patch, "_collect")
    wrap(patch, "norm_residual")
    wrap(lora_ops, "_group_fwd")
    wrap(lora_ops, "_group_bwd")
    wrap(lora_ops, "_lora_dy")
    wrap(lora_ops, "_base_dx")
    try:  # the batched casts (session 26); before them lora_ops.make_casts ran per group
        from worker.engine import lora_casts
        wrap(lora_casts.CastPlan, "begin", "CastPlan.begin")
        wrap(lora_casts, "make_casts")
        wrap(lora_casts._Group, "refresh", "_Group.refresh")
    except ImportError:
        wrap(lora_ops, "make_casts")
    wrap(knf4, "nf4_fwd")
    from worker.engine import quant
    wrap(quant, "dense_weights")
    wrap(krms, "rms_norm_fwd")
    wrap(krms, "rms_norm_bwd")
    wrap(krope, "rope_fwd")
    wrap(krope, "rope_bwd")
    wrap(kglu, "glu_fwd")
    wrap(kglu, "glu_bwd")
    wrap(attention, "attention")
    wrap(attention, "stash_choice")
    wrap(cross_entropy, "linear_cross_entropy")
    wrap(engine, "causal_lm_loss")
    wrap(engine, "hidden_states")
    # patch.py imported some names directly: rebind them to the wrapped ones
    patch.attention, patch.stash_choice = attention.attention, attention.stash_choice
    engine.attn_block, engine.mlp_block = patch.attn_block, patch.mlp_block

    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=2e-4, fused=True)
    phases = collections.defaultdict(float)
    if a.rows:
        from warmup_probe import lengths, positions
        plan = lengths(6, a.rows, a.seq)
    else:
        plan = [None] * 6
    tokens = []

    def batch(rows):
        if rows is None:
            ids = torch.randint(0, 4000, (a.bs, a.seq), device="cuda")
            return dict(input_ids=ids, labels=ids)
        ids = torch.randint(0, 4000, (1, sum(rows)), device="cuda")
        return dict(input_ids=ids, position_ids=positions(rows), labels=ids)

    def step(record, rows):
        kw = batch(rows)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = pm(**kw)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.loss.backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        if record:
            tokens.append(kw["input_ids"].numel())
            for k, v in (("forward issue", t1 - t0), ("forward GPU", t2 - t0),
                         ("backward issue", t3 - t2), ("backward GPU", t4 - t2),
                         ("optimizer", t5 - t4)):
                phases[k] += v

    for rows in plan[:3]:
        step(False, rows)
    ACC.clear()
    n = 3
    for rows in plan[3:]:
        step(True, rows)
    shape = f"{a.rows} rows padding-free (T {tokens})" if a.rows else f"{a.seq}x{a.bs}"
    print(f"## {a.config} {shape} budget={a.budget} offload={not a.no_offload} (per step)")
    print("| phase | ms |\n|---|---|")
    for k, v in phases.items():
        print(f"| {k} | {v * 1e3 / n:.1f} |")
    print("\n| function | calls | CPU ms | us per call |\n|---|---|---|---|")
    for k, (c, t) in sorted(ACC.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {c // n} | {t * 1e3 / n:.1f} | {t * 1e6 / max(c, 1):.1f} |")
    if a.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for rows in plan[3:]:
            step(False, rows)
        prof.disable()
        print(f"\n### cProfile, {n} steps, by own time")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(a.cprofile)


if __name__ == "__main__":
    main()
