"""Where a step's GPU time goes: torch.profiler over the bench model, kernels grouped by kind.

    python3 bench/profile_step.py train qlora 2048 2     # one SFT step (after 3 warm-up steps)
    ROWS=8 python3 bench/profile_step.py train qlora 2048 1  # padding-free: 8 real-like row lengths
    python3 bench/profile_step.py gen qlora 256 8 64     # generate: 8 rows, 256-token prompt, 64 new
                                                         # (engine decoder; FAST=0: HF's generate)
    python3 bench/profile_step.py time qlora 1024 16 256  # wall ms per decoded token, no profiler

Prints, per profiled step (or per generated token for ``gen``): wall ms, summed GPU kernel ms, the
GPU busy fraction (kernel time / wall: far below 1 means the CPU or copies bound the step), a table
of kernel kinds (GEMM, attention, NF4 dequant, norms, RoPE, GLU, cross-entropy, copies, other) and
the 25 most expensive kernels. Same model as bench/train_step.py (Llama-3.1-8B shapes, random).
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = [
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("nf4_dequant", ("nf4", "dequant")),
    ("cross_entropy", ("cross_entropy", "_ce_", "lce")),
    ("rms_norm", ("rms",)),
    ("rope", ("rope",)),
    ("glu", ("glu", "swiglu", "geglu")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "sm80", "cublas", "splitk")),
    ("memcpy", ("memcpy", "memset")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
]


def kind(name: str) -> str:
    n = name.lower()
    for k, keys in KINDS:
        if any(s in n for s in keys):
            return k
    return "other"


def summarise(prof, wall_s: float, per: int, label: str) -> None:
    from torch.autograd import DeviceType

    by_name = collections.Counter()
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            by_name[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") \
                else ev.cuda_time_total
    total_us = sum(by_name.values())
    by_kind = collections.Counter()
    for n, t in by_name.items():
        by_kind[kind(n)] += t
    print(f"\n## {label}: wall {wall_s * 1e3 / per:.2f} ms, GPU kernels {total_us / 1e3 / per:.2f} ms "
          f"per unit ({per} units), GPU busy {total_us / 1e6 / wall_s:.2f}")
    print("| kind | ms/unit | share |\n|---|---|---|")
    for k, t in by_kind.most_common():
        print(f"| {k} | {t / 1e3 / per:.2f} | {t / total_us:.3f} |")
    print("\n| kernel | ms/unit | share |\n|---|---|---|")
    for n, t in by_name.most_common(25):
        print(f"| {n[:110]} | {t / 1e3 / per:.3f} | {t / total_us:.3f} |")


def gaps(prof, per: int, label: str, top: int = 15) -> None:
    """GPU idle time of the compute kernels (copies excluded) and the largest gaps, each with the
    innermost CPU-side op running when it began (a sync, a Python stretch, a launch-bound stretch);
    writes the Chrome trace gzipped to $OUT when OUT is set."""
    from torch.autograd import DeviceType

    ks = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                if ev.device_type == DeviceType.CUDA and kind(ev.name) != "memcpy")
    cpu = [ev for ev in prof.events() if ev.device_type == DeviceType.CPU]
    busy, found, end = 0.0, [], None
    for s, e in ks:
        if end is None or s > end:
            if end is not None:
                found.append((s - end, end))
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = (ks[-1][1] - ks[0][0]) if ks else 0.0
    idle = sum(g for g, _ in found)
    print(f"\n## {label}: compute-kernel span {span / 1e3 / per:.2f} ms, busy {busy / 1e3 / per:.2f}, "
          f"idle {idle / 1e3 / per:.2f} ms per unit in {len(found)} gaps "
          f"({sum(g for g, _ in found if g > 50) / 1e3 / per:.2f} ms in gaps > 50 us)")
    print("| gap us | at ms | CPU ops running (innermost last) |\n|---|---|---|")
    t0 = ks[0][0] if ks else 0.0
    for g, at in sorted(found, reverse=True)[:top]:
        on = sorted((ev for ev in cpu if ev.time_range.start <= at <= ev.time_range.end),
                    key=lambda ev: ev.time_range.start)
        names = " > ".join(ev.name[:40] for ev in on[-4:])
        print(f"| {g:.0f} | {(at - t0) / 1e3:.1f} | {names} |")
    out = os.environ.get("OUT")
    if out:
        import gzip
        import shutil
        tmp = os.path.join(out, f"trace_{label.split()[0]}.json")
        prof.export_chrome_trace(tmp)
        with open(tmp, "rb") as fi, gzip.open(tmp + ".gz", "wb") as fo:
            shutil.copyfileobj(fi, fo)
        os.remove(tmp)


def train(config: str, seq: int, bs: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from train_step import build

    budget = float(os.environ["BUDGET"]) if os.environ.get("BUDGET") else None
    pm = build(config, budget, True)
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=True)
    rows = int(os.environ.get("ROWS", "0"))
    if rows:  # padding-free: one sequence of ROWS real-like row lengths (bench/warmup_probe.py)
        from warmup_probe import lengths, positions
        lens = lengths(1, rows, seq)[0]
        ids = torch.randint(0, 4000, (1, sum(lens)), device="cuda")
        kw = dict(input_ids=ids, labels=ids, position_ids=positions(lens))
        print(f"padding-free: {rows} rows, lengths {lens}, T {sum(lens)}")
    else:
        ids = torch.randint(0, 4000, (bs, seq), device="cuda")
        kw = dict(input_ids=ids, labels=ids)

    def step():
        out = pm(**kw)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    tag = os.environ.get("TAG", f"{config}{seq}x{bs}" + (f"b{budget:g}" if budget else ""))
    summarise(prof, wall, 2, f"train {config} {seq}x{bs} (per step)")
    gaps(prof, 2, f"{tag} train (per step)")


def gen(config: str, prompt: int, rows: int, new: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from train_step import build
    from worker.engine import decode
    from worker.engine.gencache import dense_generation

    pm = build(config, None, True)
    pm.eval()
    ids = torch.randint(0, 4000, (rows, prompt), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0,
              pad_token_id=0)
    fast = os.environ.get("FAST", "1") != "0"
    route = decode.fast_generate(pm, on_log=print) if fast else contextlib.nullcontext()
    with torch.no_grad(), dense_generation(pm, limit=0), route:
        pm.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=True, pad_token_id=0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            pm.generate(input_ids=ids, **kw)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    summarise(prof, wall, new, f"generate ({'engine' if fast else 'HF'}) {config} {rows} rows, prompt {prompt}, {new} new "
              "(per token)")


def decode_time(config: str, prompt: int, rows: int, new: int) -> None:
    """Wall ms per decoded token (the engine's CUDA-graph decoder, sampling, ``rows`` rows after a
    ``prompt``-token prefill), without the profiler: the median over 3 calls of
    (generate ``new`` tokens - generate 8 tokens) / (new - 8), which cancels the prefill, the
    graph capture and the set-up of a call. No ``min_new_tokens`` (as GRPO: its EOS mask syncs the
    host each token); 16 rows of random-weight sampling all ending early is improbable. Prints
    ``DECODE {json}``."""
    import json

    import torch

    from train_step import build
    from worker.engine import decode
    from worker.engine.gencache import dense_generation

    pm = build(config, None, True)
    pm.eval()
    ids = torch.randint(0, 4000, (rows, prompt), device="cuda")

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pm.generate(input_ids=ids, max_new_tokens=n, do_sample=True, temperature=1.0, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.no_grad(), dense_generation(pm, limit=0), decode.fast_generate(pm, on_log=print):
        run(8)
        per = sorted((run(new) - run(8)) / (new - 8) * 1e3 for _ in range(3))
    print("DECODE " + json.dumps(dict(config=config, prompt=prompt, rows=rows, new=new,
                                      ms_per_token=round(per[1], 3), runs=[round(p, 3) for p in per],
                                      commit=os.environ.get("WHETSTONE_COMMIT", ""))), flush=True)


if __name__ == "__main__":
    mode, config, *nums = sys.argv[1:]
    {"train": train, "gen": gen, "time": decode_time}[mode](config, *map(int, nums))
