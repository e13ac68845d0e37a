"""Where the CPU's time goes in a training step (the Python side that queues the GPU work).

    python3 bench/cpu_profile.py qlora 2048 2 [--budget GiB]

Same model and step as bench/train_step.py; 3 warm-up steps, then cProfile over 3 steps; prints the
40 functions with the most own time and the 25 with the most cumulative time (per step).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    import torch

    from train_step import build

    ap = argparse.ArgumentParser()
    ap.add_argument("config", choices=["qlora", "lora"])
    ap.add_argument("seq", type=int)
    ap.add_argument("bs", type=int)
    ap.add_argument("--budget", type=float, default=None)
    a = ap.parse_args(argv)
    pm = build(a.config, a.budget, True)
    pm.train()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=2e-4, fused=True)
    ids = torch.randint(0, 4000, (a.bs, a.seq), device="cuda")

    def step():
        out = pm(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    print("## own time (3 steps)")
    st.sort_stats("tottime").print_stats(40)
    print("## cumulative (3 steps)")
    st.sort_stats("cumtime").print_stats(25)


if __name__ == "__main__":
    main()
