"""Decode-time NF4 linear: whetstone_kernels.nf4_matmul (fused, W never materialised) against the unfused
nf4_fwd (dequant to bf16) + x @ W^T, at Llama-3.1-8B's weight shapes (N, K) and M decode rows, bf16.

Timing is what a decode step sees: the calls are captured in a CUDA graph (no Python or launch
overhead, as in worker.engine.decode) over enough distinct copies of the weight (random packed bytes,
>= 256 MiB in all) that every call reads its weight from HBM, not L2; the median of 20 replays
divided by the copies. GB/s = NF4 bytes read (N*K/2 + absmax) / time. ``per-token`` times one
Llama-3.1-8B decode step's 224 distinct weights (32 layers x q, k, v, o, gate, up, down) in one
graph. ``--sweep`` tries tile configs per shape at M=8 (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) and
at M=1 (also BLOCK_M 1 vs 16) and uses each shape's best in the per-token line (M=1's for one row,
M=8's with the row count's BLOCK_M for more). Each measurement is a JSON line appended to
--out (default $OUT/nf4_matmul.jsonl when $OUT is set, as on a device call; else bench/results.jsonl).

    python bench/nf4_matmul_bench.py [--m 1 8 16] [--sweep]
    python bench/nf4_matmul_bench.py --smoke                  # CPU, interpreter, tiny shapes: script check
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from whetstone_kernels.nf4 import nf4_fwd  # noqa: E402
from whetstone_kernels.nf4_matmul import nf4_matmul, nf4_matmul_fwd, pick_config  # noqa: E402
from whetstone_kernels.nf4_ref import nf4_quantize_ref  # noqa: E402

# (N, K) and how many of each a Llama-3.1-8B layer has (q, k+v, o, gate+up, down)
SHAPES = [((4096, 4096), 2), ((1024, 4096), 2), ((14336, 4096), 2), ((4096, 14336), 1)]
LAYERS = 32
# tile configs tried by --sweep: several rows (tensor cores; BLOCK_M from pick_config) and one row
# (BLOCK_M 1: CUDA-core FMAs, or 16: tensor cores on a padded tile)
SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sp, num_warps=w, num_stages=st)
         for bn, bk, w, st in itertools.product((64, 128, 256), (128, 256), (4, 8), (1, 2))
         for sp in (1, 2, 4, 8, 16)]
SWEEP_1 = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sp, num_warps=w, num_stages=1)
           for bm, bn, bk, w in itertools.product((1, 16), (32, 64, 128), (128, 256), (4, 8))
           for sp in (1, 2, 4, 8, 16)]


def _graph_ms(calls, reps=20):
    """Median ms of one replay of a CUDA graph running ``calls`` in order (eager time on CPU)."""
    import time

    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e3
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles) off the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    del g
    return sorted(ts)[len(ts) // 2]


def _copies(packed, n):
    """``n`` weights with the same state and random packed bytes (timing only)."""
    return [packed] + [torch.randint(0, 256, packed.shape, dtype=torch.uint8, device=packed.device)
                       for _ in range(n - 1)]


def _commit():
    try:
        import subprocess

        return subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "nf4_matmul.jsonl") if os.environ.get("OUT")
                    else os.path.join(ROOT, "bench", "results.jsonl"))
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = [((72, 128), 2), ((40, 320), 1)] if args.smoke else SHAPES
    layers = 2 if args.smoke else LAYERS
    torch.manual_seed(0)
    common = dict(bench="nf4_matmul", device=torch.cuda.get_device_name() if dev == "cuda" else "cpu-interpreter",
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), commit=_commit(),
                  call_id=os.environ.get("CALL_ID", uuid.uuid4().hex[:12]), torch=torch.__version__,
                  triton=__import__("triton").__version__, dtype=str(dtype).replace("torch.", ""),
                  timing="cuda-graph, HBM-resident weights")
    print(f"# {common['device']}, {common['dtype']}, call_id {common['call_id']}, {common['timing']}", flush=True)
    best_cfg = {}
    weights = {}
    with open(args.out, "a") as f, torch.no_grad():
        for (n, k), count in shapes:
            packed, st = nf4_quantize_ref(torch.randn(n, k, device=dev) * 0.02)
            weights[(n, k)] = (packed, st)
            nbytes = n * k // 2 + st.absmax.numel() + 4 * (st.absmax2.numel() if st.nested else 0)
            cps = _copies(packed, 2 if args.smoke else max(4, -(-(256 << 20) // (n * k // 2))))
            for m in args.m:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                y = nf4_matmul(x, packed, st)
                want = x @ nf4_fwd(packed, st, dtype).t()
                err = ((y.float() - want.float()).norm() / want.float().norm()).item()
                fused = _graph_ms([lambda p=p: nf4_matmul(x, p, st) for p in cps]) / len(cps)
                unfused = _graph_ms([lambda p=p: x @ nf4_fwd(p, st, dtype).t() for p in cps]) / len(cps)
                cfg = pick_config(m, n, k, st.blocksize, x.device)
                row = dict(common, shape=f"{m}x{k}->{n}", m=m, n=n, k=k, fused_ms=round(fused, 5),
                           unfused_ms=round(unfused, 5), gbps=round(nbytes / fused / 1e6, 1),
                           speedup=round(unfused / fused, 2), rel_err=err, config=cfg)
                f.write(json.dumps(row) + "\n")
                print(f"M={m:3d} N={n:6d} K={k:6d}  fused {fused * 1e3:8.1f} us {row['gbps']:7.0f} GB/s   "
                      f"dequant+matmul {unfused * 1e3:8.1f} us   x{row['speedup']:5.2f}   rel_err {err:.1e}   "
                      f"{cfg}", flush=True)
                if args.sweep and dev == "cuda" and m in (1, 8):
                    found = []
                    for c in (SWEEP_1 if m == 1 else SWEEP):
                        c = dict(c) if m == 1 else dict(c, BLOCK_M=cfg["BLOCK_M"])
                        try:
                            t = _graph_ms([lambda p=p: nf4_matmul_fwd(x, p, st, None, c) for p in cps],
                                          reps=5) / len(cps)
                        except Exception as ex:  # e.g. out of shared memory
                            print(f"#   {c} failed: {ex!r}"[:160])
                            continue
                        found.append((t, c))
                    found.sort(key=lambda tc: tc[0])
                    best_cfg[(n, k, m)] = found[0][1]
                    for t, c in found[:5]:
                        print(f"#   sweep M={m} {t * 1e3:7.1f} us {nbytes / t / 1e6:5.0f} GB/s {c}", flush=True)
                    f.write(json.dumps(dict(common, shape=f"{m}x{k}->{n}", m=m, n=n, k=k, sweep=[
                        dict(c, ms=round(t, 5)) for t, c in found[:10]])) + "\n")
        for m in args.m:  # one decode step: 224 distinct weights, in layer order
            x = {k: torch.randn(m, k, device=dev, dtype=dtype) for (_, k), _ in shapes}
            calls_f, calls_u, calls_b = [], [], []
            for _ in range(layers):
                for (n, k), count in shapes:
                    packed, st = weights[(n, k)]
                    for p in _copies(packed, count + 1)[1:]:
                        xx, c = x[k], best_cfg.get((n, k, 1 if m == 1 else 8))
                        calls_f.append(lambda p=p, xx=xx, st=st: nf4_matmul(xx, p, st))
                        calls_u.append(lambda p=p, xx=xx, st=st: xx @ nf4_fwd(p, st, dtype).t())
                        if c:  # M=1's sweep chose BLOCK_M itself; M=8's tiles take this M's
                            if m != 1:
                                c = dict(c, BLOCK_M=pick_config(m, n, k, st.blocksize, xx.device)["BLOCK_M"])
                            calls_b.append(lambda p=p, xx=xx, st=st, c=c: nf4_matmul_fwd(xx, p, st, None, c))
            a, b = _graph_ms(calls_f), _graph_ms(calls_u)
            t_best = _graph_ms(calls_b) if len(calls_b) == len(calls_f) else None
            f.write(json.dumps(dict(common, shape=f"per-token M={m}", m=m, fused_ms=round(a, 4),
                                    unfused_ms=round(b, 4), swept_ms=t_best and round(t_best, 4))) + "\n")
            print(f"per-token (32 layers x 7 weights), M={m}: fused {a:.3f} ms, dequant+matmul {b:.3f} ms, "
                  f"x{b / a:.2f}" + (f"; swept configs {t_best:.3f} ms" if t_best else ""), flush=True)
            del calls_f, calls_u, calls_b


if __name__ == "__main__":
    main()
