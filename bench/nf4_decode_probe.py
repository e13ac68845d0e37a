"""Where the NF4 decode matmul's time goes (s19-c2): variants of a several-row kernel that each leave
one thing out, timed like bench/nf4_matmul_bench.py (CUDA graph over HBM-resident weight copies), with
each compiled kernel's registers and spills. The kernel probed is the two-dot variant of f91d9bf
(per piece of an absmax block, code[hi] . x_even and code[lo] . x_odd as two tensor-core dots scaled
by the absmax), which 1040df7 did not keep for several rows: whetstone_kernels/nf4_matmul.py
dequantises W's chunk, interleaves it into k order and makes one dot (bench/RESULTS.md, session 19).

MODE 0 full (the two-dot variant's maths), 1 no table lookup (the nibble itself converted to a
float: wrong values, the dots kept), 2 no dots (lookups summed elementwise, no x), 3 bytes only
(the packed bytes summed: the load structure's bound). PREFETCH 1 loads the next piece's bytes
before computing on the current one (software pipelining in registers). Only modes 0 give right
numbers; the others are timing probes. Prints one line per (shape, M, variant) and a JSON row each
to --out.

    python3 bench/nf4_decode_probe.py [--m 1 8 16]     # M <= 16: one 16-row tile
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.nf4_matmul_bench import _copies, _graph_ms  # noqa: E402
from whetstone_kernels.nf4 import _code, block_absmax  # noqa: E402
from whetstone_kernels.nf4_ref import nf4_dequantize_ref, nf4_quantize_ref  # noqa: E402


@triton.jit
def _probe(X, Q, ABSMAX, ABSMAX2, CODE2, OFFSET, CODE, Y, M, N, K, KH, k_per_split, stride_xm,
           BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           PIECE: tl.constexpr, MODE: tl.constexpr, PREFETCH: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HP: tl.constexpr = PIECE // 2
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    jj = tl.arange(0, HP)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    q_tile = Q + offs_n[:, None] * KH + jj[None, :]
    blk_row = offs_n * (K // BLOCKSIZE)
    x_even = X + offs_m[None, :] * stride_xm + 2 * jj[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, HP], dtype=tl.float32)
    b = tl.load(q_tile + k_start // 2, mask=n_ok[:, None], other=0)
    for kp in range(k_start, k_end, PIECE):
        if PREFETCH:
            cur = b
            b = tl.load(q_tile + (kp + PIECE) // 2, mask=n_ok[:, None] & (kp + PIECE < k_end), other=0)
        else:
            cur = tl.load(q_tile + kp // 2, mask=n_ok[:, None], other=0)
        c = cur.to(tl.int32)
        if MODE == 3:
            acc1 += c.to(tl.float32)
        else:
            amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk_row + kp // BLOCKSIZE, n_ok, BLOCKSIZE2, True)
            if MODE == 1:
                hi = (c >> 4).to(X.dtype.element_ty)
                lo = (c & 15).to(X.dtype.element_ty)
            else:
                hi = tl.load(CODE + (c >> 4))
                lo = tl.load(CODE + (c & 15))
            if MODE == 2:
                acc1 += (hi.to(tl.float32) + lo.to(tl.float32)) * amax[:, None]
            else:
                xe = tl.load(x_even + kp, mask=m_ok[None, :], other=0.0)
                xo = tl.load(x_even + kp + 1, mask=m_ok[None, :], other=0.0)
                part = tl.dot(hi, xe)
                part = tl.dot(lo, xo, part)
                acc += part * amax[:, None]
    acc += tl.sum(acc1, axis=1)[:, None]
    tl.atomic_add(Y + offs_m[None, :] * N + offs_n[:, None], acc, mask=n_ok[:, None] & m_ok[None, :], sem="relaxed")


def run(x, packed, st, y, cfg, mode, prefetch, table):
    M, K = x.shape
    N = st.shape[0]
    bn, piece, split = cfg["BLOCK_N"], cfg["PIECE"], cfg["SPLIT_K"]
    chunks = K // piece
    kps = -(-chunks // split) * piece
    grid = (-(-N // bn), -(-K // kps))
    off = st.offset if st.offset.dtype == torch.float32 else st.offset.float()
    return _probe[grid](x, packed, st.absmax, st.absmax2, st.code2, off, table, y, M, N, K, K // 2, kps,
                        x.stride(0), BLOCKSIZE=st.blocksize, BLOCKSIZE2=st.blocksize2, BLOCK_M=16, BLOCK_N=bn,
                        PIECE=piece, MODE=mode, PREFETCH=prefetch, num_warps=cfg["num_warps"], num_stages=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[8])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "nf4_probe.jsonl"))
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    table = _code("cuda").to(dt)
    cfgs = [dict(BLOCK_N=64, PIECE=64, SPLIT_K=s, num_warps=4) for s in (4, 16)] + \
           [dict(BLOCK_N=128, PIECE=64, SPLIT_K=8, num_warps=4), dict(BLOCK_N=64, PIECE=128, SPLIT_K=8, num_warps=4),
            dict(BLOCK_N=32, PIECE=128, SPLIT_K=16, num_warps=2)]
    with open(args.out, "a") as f, torch.no_grad():
        for n, k in ((14336, 4096), (4096, 4096)):
            packed, st = nf4_quantize_ref(torch.randn(n, k, device="cuda") * 0.02)
            nbytes = n * k // 2 + st.absmax.numel()
            cps = _copies(packed, max(4, -(-(256 << 20) // (n * k // 2))))
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=dt)
                y = torch.zeros(m, n, device="cuda", dtype=torch.float32)
                want = (x.float() @ nf4_dequantize_ref(packed, st, torch.float32).t())
                for pf in (0, 1):  # mode 0 is the right answer (with or without the prefetch)
                    y.zero_()
                    run(x, packed, st, y, cfgs[0], 0, pf, table)
                    print(f"check M={m} {n}x{k} prefetch={pf}: rel err {((y - want).norm() / want.norm()).item():.1e}")
                for cfg in cfgs:
                    for mode in (0, 1, 2, 3):
                        for pf in (0, 1):
                            ck = run(x, packed, st, y, cfg, mode, pf, table)
                            t = _graph_ms([lambda p=p: run(x, p, st, y, cfg, mode, pf, table) for p in cps],
                                          reps=7) / len(cps)
                            row = dict(shape=f"{n}x{k}", m=m, cfg=cfg, mode=mode, prefetch=pf, us=round(t * 1e3, 2),
                                       gbps=round(nbytes / t / 1e6), n_regs=getattr(ck, "n_regs", None),
                                       n_spills=getattr(ck, "n_spills", None))
                            f.write(json.dumps(row) + "\n")
                            print(f"{n}x{k} M={m} {cfg} mode={mode} pf={pf}: {row['us']:7.1f} us "
                                  f"{row['gbps']:5d} GB/s regs={row['n_regs']} spills={row['n_spills']}", flush=True)


if __name__ == "__main__":
    main()
