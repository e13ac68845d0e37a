"""One projection group's NF4 dequant: per weight (nf4_fwd per weight) vs grouped (nf4_fwd_group),
Llama-3.1-8B shapes (q/k/v, gate/up), bf16 out. GPU us per group (CUDA events over 50 calls) and
CPU us per group issue (no sync in the loop), plus a bit-identity check.

    python3 bench/nf4_group_probe.py
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, n=50):
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    cpu = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return cpu * 1e6, e0.elapsed_time(e1) * 1e3 / n


def main():
    import torch

    from kernels.nf4 import nf4_fwd, nf4_fwd_group
    from kernels.nf4_ref import nf4_quantize_ref

    torch.manual_seed(0)
    groups = {"qkv": [(4096, 4096), (1024, 4096), (1024, 4096)], "gate_up": [(14336, 4096)] * 2}
    print("| group | path | CPU us per group | GPU us per group | bit-identical |\n|---|---|---|---|---|")
    for name, shapes in groups.items():
        parts = [nf4_quantize_ref(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
        ref = torch.cat([nf4_fwd(p, st, torch.bfloat16) for p, st in parts])
        got = nf4_fwd_group(parts, torch.bfloat16)
        same = bool(torch.equal(ref.view(torch.int16), got.view(torch.int16)))
        c, g = timed(lambda: [nf4_fwd(p, st, torch.bfloat16) for p, st in parts])
        print(f"| {name} | per weight | {c:.1f} | {g:.1f} | |")
        c, g = timed(lambda: nf4_fwd_group(parts, torch.bfloat16))
        print(f"| {name} | grouped | {c:.1f} | {g:.1f} | {same} |")


if __name__ == "__main__":
    main()
