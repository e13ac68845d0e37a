"""Where a training run's first steps go: Triton compiles vs everything else (issue 17, the job's warm-up).

The worker's SFT job runs padding-free batches by default: every step is one packed sequence of a
different length T (the sum of 8 rows' lengths). Its first steps are slower than the rest (call
s18-c1: step 1 3.0-3.6 s, steps 2-3 another 1.3-1.6 s, on a 0.27 s step). This probe runs the engine
alone (bench/train_step.py's QLoRA Llama-3.1-8B, random weights) on such packed steps, lengths from
a fixed lognormal draw like the real rows (median ~240 tokens, at most --max-len), and records per
step: wall seconds (synchronised), tokens, the Triton kernels compiled in that step (Triton's
``jit_cache_hook`` / ``jit_post_compile_hook``: an in-memory cache miss, then the compile, which reads
Triton's on-disk cache when that holds the kernel) and their seconds, and the pinned host blocks
the offloader allocated (worker.engine.pinned.PinnedPool) and their seconds. After the probed steps it
re-runs the first --steady lengths to get the steady seconds per token; each probed step's excess
is wall - T x that.

    TRITON_CACHE_DIR=/tmp/tc python3 bench/warmup_probe.py [--steps 12] [--rows 8] [--tag cold]

Prints one ``STEP`` line a step and ``RESULT {json}`` (bench="warmup_probe").
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lengths(n_steps: int, rows: int, max_len: int, seed: int = 7) -> list:
    """[[row lengths] per step]: lognormal (median 240, sigma 0.9) clipped to [20, max_len]."""
    import random

    rnd = random.Random(seed)
    return [[max(20, min(max_len, int(rnd.lognormvariate(5.48, 0.9)))) for _ in range(rows)]
            for _ in range(n_steps)]


def positions(rows: list, device="cuda"):
    """position_ids [1, sum(rows)] int64 of one padding-free sequence of rows of these lengths:
    arange(n) for each row, as the worker's padding-free collator makes them."""
    import torch

    return torch.cat([torch.arange(n, device=device) for n in rows])[None]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--steady", type=int, default=4)
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)

    import torch
    from triton import knobs

    from bench.train_step import build

    compiled, started = [], {}

    def pre(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        started[repr] = time.perf_counter()
        return False

    def post(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiled.append((fn.name, time.perf_counter() - started.pop(repr, time.perf_counter())))
        return False

    knobs.runtime.jit_cache_hook = pre
    knobs.runtime.jit_post_compile_hook = post
    from worker.engine import pinned

    pin = [0, 0.0]  # new pinned blocks, seconds in the takes that made them
    take = pinned.PinnedPool.take_pieces

    def timed_take(self, *args, **kw):
        n, t = self.allocs, time.perf_counter()
        out = take(self, *args, **kw)
        if self.allocs > n:
            pin[0] += self.allocs - n
            pin[1] += time.perf_counter() - t
        return out

    pinned.PinnedPool.take_pieces = timed_take
    t0 = time.perf_counter()
    pm = build("qlora", None, True)
    pm.train()
    load_s = time.perf_counter() - t0
    load_compiles = len(compiled)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=2e-4, fused=True)
    plan = lengths(a.steps, a.rows, a.max_len)
    g = torch.Generator(device="cuda").manual_seed(1)

    def step(rows):
        T = sum(rows)
        ids = torch.randint(0, 4000, (1, T), device="cuda", generator=g)
        pos = positions(rows)
        labels = ids.clone()
        torch.cuda.synchronize()
        start, before, pin0 = time.perf_counter(), len(compiled), list(pin)
        loss = pm(input_ids=ids, position_ids=pos, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        new = compiled[before:]
        return T, time.perf_counter() - start, new, (pin[0] - pin0[0], pin[1] - pin0[1])

    steps = []
    for i, rows in enumerate(plan):
        T, wall, new, (n_pin, pin_s) = step(rows)
        steps.append(dict(step=i + 1, tokens=T, wall_s=round(wall, 4), compiles=len(new),
                          compile_s=round(sum(s for _, s in new), 3), pinned_blocks=n_pin,
                          pinned_s=round(pin_s, 3),
                          kernels=sorted({n for n, _ in new})))
        print("STEP", json.dumps(steps[-1]), flush=True)
    steady = [step(rows) for rows in plan[:a.steady]]
    per_tok = sum(w for _, w, _, _ in steady) / sum(t for t, _, _, _ in steady)
    for s in steps:
        s["excess_s"] = round(s["wall_s"] - s["tokens"] * per_tok, 3)
    res = dict(bench="warmup_probe", tag=a.tag, device=torch.cuda.get_device_name(),
               date=datetime.date.today().isoformat(), commit=os.environ.get("WHETSTONE_COMMIT", "unknown"),
               call_id=os.environ.get("CALL_ID", ""), triton_cache_dir=os.environ.get("TRITON_CACHE_DIR", ""),
               load_s=round(load_s, 1), load_compiles=load_compiles, steady_ms_per_ktok=round(per_tok * 1e6, 2),
               steady_recompiles=sum(len(n) for _, _, n, _ in steady),
               excess_total_s=round(sum(s["excess_s"] for s in steps), 2),
               compile_total_s=round(sum(s["compile_s"] for s in steps), 2), steps=steps)
    print("RESULT", json.dumps(res), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "warmup_probe.jsonl"), "a") as fh:
        fh.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
