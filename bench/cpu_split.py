"""Where the CPU's time goes in a training step, without a profiler: wall-clock accumulators
wrapped around the engine's functions (about 1 us of overhead per call).

    python3 bench/cpu_split.py qlora 2048 2 [--budget GiB] [--no-offload]

Same model and step as bench/train_step.py; after 3 warm-up steps, 3 steps are measured. Prints per
step: the forward's and backward's issue time (CPU) and GPU time, and for each wrapped function its
calls and CPU ms (inclusive: nested wrapped functions count in both).
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
    ids = torch.randint(0, 4000, (a.bs, a.seq), device="cuda")
    phases = collections.defaultdict(float)

    def step(record):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = pm(input_ids=ids, labels=ids)
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
            for k, v in (("forward issue", t1 - t0), ("forward GPU", t2 - t0),
                         ("backward issue", t3 - t2), ("backward GPU", t4 - t2),
                         ("optimizer", t5 - t4)):
                phases[k] += v

    for _ in range(3):
        step(False)
    ACC.clear()
    n = 3
    for _ in range(n):
        step(True)
    print(f"## {a.config} {a.seq}x{a.bs} budget={a.budget} offload={not a.no_offload} (per step)")
    print("| phase | ms |\n|---|---|")
    for k, v in phases.items():
        print(f"| {k} | {v * 1e3 / n:.1f} |")
    print("\n| function | calls | CPU ms | us per call |\n|---|---|---|---|")
    for k, (c, t) in sorted(ACC.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {c // n} | {t * 1e3 / n:.1f} | {t * 1e6 / max(c, 1):.1f} |")


if __name__ == "__main__":
    main()
