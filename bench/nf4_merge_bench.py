"""The LoRA term merged into the NF4 dequantisation (whetstone_kernels/nf4_merge.py) vs kept separate.

At each Llama-3.1-8B weight shape [N, K] (r=16, bf16, T tokens), times with CUDA events (median of
--reps runs; each run preceded by a 512 MiB read that evicts L2 and keeps the GPU busy while the
launches are queued, so host overhead is not timed):

* ``dequant``  nf4_fwd: W alone (the plain dequantisation)
* ``merged``   nf4_merged: W + s B A, for each launch config of --bn x --nb x --warps (the default first)
* ``fwd_sep``  the engine's forward before the merge: Y = (X A^T) (s B)^T, then Y += X W^T (cuBLAS,
  beta 1), with W dequantised
* ``fwd_mer``  Y = X (W + s B A)^T, W' from nf4_merged
* ``bwd_sep`` / ``bwd_mer``  dX = (dY s B) A, then dX += dY W  vs  dX = dY W'

Every merged config is first checked against the fp64 sum (within one bf16 ulp). Prints a markdown
table and ``RESULT {json}`` rows (bench="nf4_merge") for bench/results.jsonl.

    python3 bench/nf4_merge_bench.py [--tokens 4096] [--bn 16 32 64] [--nb 2 4 8] [--warps 4 8]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from whetstone_kernels import nf4_merge  # noqa: E402
from whetstone_kernels.nf4 import nf4_fwd  # noqa: E402
from whetstone_kernels.nf4_ref import nf4_dequantize_ref, nf4_quantize_ref  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]


def timed(fn, reps):
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        flush.add_(1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--bn", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--nb", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    dt, T, r = torch.bfloat16, a.tokens, a.rank
    meta = dict(bench="nf4_merge", device=torch.cuda.get_device_name(), date=str(datetime.date.today()),
                commit=os.environ.get("WHETSTONE_COMMIT", "unknown"), call_id=os.environ.get("CALL_ID", ""),
                tokens=T, rank=r)
    default = (nf4_merge.MERGE_BN, nf4_merge.MERGE_NB, nf4_merge.MERGE_WARPS)
    configs = [default] + [(bn, nb, w) for bn in a.bn for nb in a.nb for w in a.warps if (bn, nb, w) != default]
    print("| N x K | dequant us | merged us (default) | best merged (bn, nb, warps) | fwd sep | fwd merged | bwd sep | bwd merged |")
    print("|---|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        packed, st = nf4_quantize_ref(torch.randn(n, k, device="cuda") * 0.02)
        A = (torch.randn(r, k, device="cuda") * 0.02).to(dt)
        Bs = (torch.randn(n, r, device="cuda") * 0.01).to(dt)
        X = torch.randn(T, k, device="cuda", dtype=dt)
        dY = torch.randn(T, n, device="cuda", dtype=dt)
        exact = nf4_dequantize_ref(packed, st, torch.float32).double() + Bs.double() @ A.double()
        times = {}
        for bn, nb, w in configs:
            try:
                got = nf4_merge.nf4_merged(packed, st, A, Bs, dt, bn=bn, nb=nb, num_warps=w)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"# {n}x{k} bn={bn} nb={nb} warps={w}: {type(e).__name__}: {str(e)[:120]}")
                continue
            ok = bool(((got.double() - exact).abs() <= torch.finfo(dt).eps * exact.abs() + 1e-7).all())
            if not ok:
                print(f"# {n}x{k} bn={bn} nb={nb} warps={w}: WRONG")
                continue
            times[(bn, nb, w)] = timed(lambda: nf4_merge.nf4_merged(packed, st, A, Bs, dt, bn=bn, nb=nb,
                                                                    num_warps=w), a.reps)
        best = min(times, key=times.get)
        t_deq = timed(lambda: nf4_fwd(packed, st, dt), a.reps)

        def fwd_sep():
            W = nf4_fwd(packed, st, dt)
            Y = (X @ A.t()) @ Bs.t()
            Y.addmm_(X, W.t())

        def fwd_mer():
            W = nf4_merge.nf4_merged(packed, st, A, Bs, dt, bn=best[0], nb=best[1], num_warps=best[2])
            X @ A.t()  # XA is still computed (backward's dB needs it)
            X @ W.t()

        def bwd_sep():
            W = nf4_fwd(packed, st, dt)
            dX = (dY @ Bs) @ A
            dX.addmm_(dY, W)

        def bwd_mer():
            W = nf4_merge.nf4_merged(packed, st, A, Bs, dt, bn=best[0], nb=best[1], num_warps=best[2])
            dY @ Bs  # dY s B is still computed (dA needs it)
            dY @ W

        t = {name: timed(f, a.reps) for name, f in
             (("fwd_sep", fwd_sep), ("fwd_mer", fwd_mer), ("bwd_sep", bwd_sep), ("bwd_mer", bwd_mer))}
        print(f"| {n} x {k} | {t_deq:.1f} | {times.get(default, float('nan')):.1f} | {times[best]:.1f} {best} | "
              f"{t['fwd_sep']:.1f} | {t['fwd_mer']:.1f} | {t['bwd_sep']:.1f} | {t['bwd_mer']:.1f} |")
        row = dict(meta, shape=[n, k], dequant_us=round(t_deq, 1),
                   merged_default_us=round(times.get(default, float("nan")), 1),
                   merged_best_us=round(times[best], 1), best_config=list(best),
                   **{f"{k_}_us": round(v, 1) for k_, v in t.items()})
        print("RESULT", json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
