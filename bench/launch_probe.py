"""CPU cost of one kernel launch, per kind (the Python side that queues GPU work).

    python3 bench/launch_probe.py

Small tensors (GPU time per kernel a few us), 300 calls each after warm-up, CPU time per call
without a sync in the loop. Also prints what is registered on Triton's launch hooks after the
engine's imports (a hook runs on every Triton launch).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def per_call(fn, n=300):
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return t * 1e6


def main():
    import torch
    import triton

    import peft  # noqa: F401  (what the bench process imports)
    import transformers  # noqa: F401
    from whetstone_kernels import nf4
    from whetstone_kernels.nf4_ref import nf4_quantize_ref
    from whetstone_kernels.rms_norm import rms_norm_fwd
    from whetstone_kernels.swiglu import glu_fwd
    from worker.engine import engine  # noqa: F401

    print("launch_enter_hook.calls:", triton.knobs.runtime.launch_enter_hook.calls)
    print("launch_exit_hook.calls:", triton.knobs.runtime.launch_exit_hook.calls)
    dev = "cuda"
    w = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    packed, st = nf4_quantize_ref(w)
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    g = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    rows = []
    rows.append(("nf4_fwd (as the engine calls it)", per_call(lambda: nf4.nf4_fwd(packed, st, torch.bfloat16))))
    saved = nf4.INTERPRET
    nf4.INTERPRET = True  # same launch without the enable_fp_fusion keyword
    try:
        rows.append(("nf4_fwd without enable_fp_fusion kwarg", per_call(
            lambda: nf4.nf4_fwd(packed, st, torch.bfloat16))))
    finally:
        nf4.INTERPRET = saved
    rows.append(("rms_norm_fwd", per_call(lambda: rms_norm_fwd(x, w[0]))))
    rows.append(("glu_fwd", per_call(lambda: glu_fwd(g, x, "silu"))))
    import whetstone_kernels.launch as L  # the same three through Triton's own launch (whetstone_kernels.launch off)

    L.FAST_LAUNCH = False
    try:
        rows.append(("nf4_fwd, Triton's launch", per_call(lambda: nf4.nf4_fwd(packed, st, torch.bfloat16))))
        rows.append(("rms_norm_fwd, Triton's launch", per_call(lambda: rms_norm_fwd(x, w[0]))))
        rows.append(("glu_fwd, Triton's launch", per_call(lambda: glu_fwd(g, x, "silu"))))
    finally:
        L.FAST_LAUNCH = True
    rows.append(("torch.mm 64x64", per_call(lambda: a @ a)))
    rows.append(("torch.empty", per_call(lambda: torch.empty(64, 4096, device=dev))))
    print("| launch | CPU us per call |\n|---|---|")
    for n, t in rows:
        print(f"| {n} | {t:.1f} |")


if __name__ == "__main__":
    main()
