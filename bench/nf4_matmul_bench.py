"""Decode-time NF4 linear: kernels.nf4_matmul (fused, W never materialised) against the unfused
nf4_fwd (dequant to bf16) + x @ W^T, at Llama-3.1-8B's weight shapes (N, K) and M decode rows, bf16.

Timing: triton.testing.do_bench (L2 flushed before each call, so the weight is read from HBM as in a
real decode step), median. GB/s = NF4 bytes read (N*K/2 + absmax) / time. ``per-token`` sums one
Llama-3.1-8B decode step's 224 weights (32 layers x q, k, v, o, gate, up, down). Each measurement is a
JSON line appended to --out (default bench/results.jsonl).

    python bench/nf4_matmul_bench.py [--m 1 8 16] [--sweep]   # --sweep: also try tile configs per shape (M=8)
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

from kernels.nf4 import nf4_fwd  # noqa: E402
from kernels.nf4_matmul import nf4_matmul, nf4_matmul_fwd, pick_config  # noqa: E402
from kernels.nf4_ref import nf4_quantize_ref  # noqa: E402

# (N, K) and how many of each a Llama-3.1-8B layer has (q, k+v, o, gate+up, down)
SHAPES = [((4096, 4096), 2), ((1024, 4096), 2), ((14336, 4096), 2), ((4096, 14336), 1)]
LAYERS = 32


def _ms(fn, dev):
    if dev == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


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
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results.jsonl"))
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = [((72, 128), 2), ((40, 320), 1)] if args.smoke else SHAPES
    torch.manual_seed(0)
    common = dict(bench="nf4_matmul", device=torch.cuda.get_device_name() if dev == "cuda" else "cpu-interpreter",
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), commit=_commit(),
                  call_id=uuid.uuid4().hex[:12], torch=torch.__version__, triton=__import__("triton").__version__,
                  dtype=str(dtype).replace("torch.", ""))
    print(f"# {common['device']}, {common['dtype']}, call_id {common['call_id']}", flush=True)
    per_token = {m: [0.0, 0.0] for m in args.m}
    with open(args.out, "a") as f, torch.no_grad():
        for (n, k), count in shapes:
            packed, st = nf4_quantize_ref(torch.randn(n, k, device=dev) * 0.02)
            nbytes = n * k // 2 + st.absmax.numel() + 4 * (st.absmax2.numel() if st.nested else 0)
            for m in args.m:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                y = nf4_matmul(x, packed, st)
                want = x @ nf4_fwd(packed, st, dtype).t()
                err = ((y.float() - want.float()).norm() / want.float().norm()).item()
                fused = _ms(lambda: nf4_matmul(x, packed, st), dev)
                unfused = _ms(lambda: x @ nf4_fwd(packed, st, dtype).t(), dev)
                per_token[m][0] += LAYERS * count * fused
                per_token[m][1] += LAYERS * count * unfused
                cfg = pick_config(m, n, k, st.blocksize, x.device)
                row = dict(common, shape=f"{m}x{k}->{n}", m=m, n=n, k=k, fused_ms=round(fused, 4),
                           unfused_ms=round(unfused, 4), gbps=round(nbytes / fused / 1e6, 1),
                           speedup=round(unfused / fused, 2), rel_err=err, config=cfg)
                f.write(json.dumps(row) + "\n")
                print(f"M={m:3d} N={n:6d} K={k:6d}  fused {fused * 1e3:8.1f} us {row['gbps']:7.0f} GB/s   "
                      f"dequant+matmul {unfused * 1e3:8.1f} us   x{row['speedup']:5.2f}   rel_err {err:.1e}   "
                      f"{cfg}", flush=True)
                if args.sweep and dev == "cuda" and m == 8:
                    best = None
                    for bn, bk, sp, w, s in itertools.product((32, 64, 128), (128, 256, 512), (2, 4, 8, 16),
                                                              (4, 8), (1,)):
                        c = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sp, num_warps=w,
                                 num_stages=s)
                        try:
                            t = _ms(lambda: nf4_matmul_fwd(x, packed, st, None, c), dev)
                        except Exception as ex:  # e.g. out of shared memory
                            print(f"#   {c} failed: {ex!r}"[:160])
                            continue
                        if best is None or t < best[0]:
                            best = (t, c)
                    print(f"#   sweep best {best[0] * 1e3:.1f} us {nbytes / best[0] / 1e6:.0f} GB/s {best[1]}",
                          flush=True)
    for m, (a, b) in per_token.items():
        print(f"per-token (32 layers x 7 weights), M={m}: fused {a:.3f} ms, dequant+matmul {b:.3f} ms, "
              f"x{b / a:.2f}")


if __name__ == "__main__":
    main()
