"""Decode attention at GRPO's shape: the decoder's former eager path (q @ K^T over all P + T cache
columns, mask, fp32 softmax, @ V) against whetstone_kernels.decode_attention (the columns written
so far), Llama-3.1-8B heads (32 q, 8 kv, D 128), bf16, 32 layers' caches, one CUDA graph each.

    python3 bench/decode_attention_bench.py [--rows 16] [--total 2048] [--cols 1024 1536 2047]

Prints ms per token (32 layers) and the GB/s of the K/V columns read; appends JSON rows
(bench "decode_attention") to $OUT/decode_attention.jsonl, else bench/results.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

from nf4_matmul_bench import _commit, _graph_ms  # noqa: E402
from whetstone_kernels.decode_attention import decode_attention  # noqa: E402


def eager(q, kc, vc, valid, scale):
    B, Hq, D = q.shape
    Hk = kc.shape[1]
    sc = (q.reshape(B, Hk, Hq // Hk, D) @ kc.transpose(-1, -2)).float() * scale
    sc = sc.masked_fill(~valid[:, None, None, :], float("-inf"))
    return (torch.softmax(sc, -1).to(vc.dtype) @ vc).reshape(B, Hq, D)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--total", type=int, default=2048)
    ap.add_argument("--cols", type=int, nargs="+", default=[1024, 1536, 2047])
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "decode_attention.jsonl") if os.environ.get("OUT")
                    else os.path.join(ROOT, "bench", "results.jsonl"))
    a = ap.parse_args()
    dev, dt, layers = "cuda", torch.bfloat16, 32
    B, L, Hq, Hk, D = a.rows, a.total, 32, 8, 128
    q = torch.randn(B, Hq, D, device=dev, dtype=dt)
    caches = [(torch.randn(B, Hk, L, D, device=dev, dtype=dt), torch.randn(B, Hk, L, D, device=dev, dtype=dt))
              for _ in range(layers)]
    valid = torch.zeros(B, L, dtype=torch.bool, device=dev)
    col = torch.zeros(1, dtype=torch.long, device=dev)
    common = dict(bench="decode_attention", device=torch.cuda.get_device_name(), rows=B, total_cols=L,
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), commit=os.environ.get("WHETSTONE_COMMIT") or _commit(),
                  call_id=os.environ.get("CALL_ID", "local"), dtype="bfloat16", layers=layers)
    with open(a.out, "a") as f, torch.no_grad():
        for c in a.cols:
            col.fill_(c)
            valid.zero_()
            valid[:, :c + 1] = True
            e = _graph_ms([lambda kc=kc, vc=vc: eager(q, kc, vc, valid, 0.088) for kc, vc in caches])
            k = _graph_ms([lambda kc=kc, vc=vc: decode_attention(q, kc, vc, valid, col, 0.088) for kc, vc in caches])
            read = layers * 2 * B * Hk * (c + 1) * D * 2
            row = dict(common, col=c, eager_ms=round(e, 4), kernel_ms=round(k, 4), speedup=round(e / k, 2),
                       kernel_gbps=round(read / k / 1e6, 1))
            f.write(json.dumps(row) + "\n")
            print(f"rows {B}, col {c}/{L}: eager {e:.3f} ms, kernel {k:.3f} ms per token (32 layers), "
                  f"x{e / k:.2f}, kernel {row['kernel_gbps']:.0f} GB/s of K/V", flush=True)


if __name__ == "__main__":
    main()
