"""NF4 dequantisation launch sweep: tile size (output elements per program), num_warps and store path
(``pack``: one 32-bit word per packed byte, or join + interleave) of whetstone_kernels/nf4.py's ``nf4_fwd``,
plus the kernel as it was before them (commit 965c674: 2048 elements, 4 warps, byte-wise loads) as
the baseline, at Llama-3.1-8B weight shapes.

For each shape a random double-quantised NF4 weight is made with whetstone_kernels/nf4_ref.py's quantiser (no
bitsandbytes needed); every candidate is first checked bit-exact (torch.equal) against
``nf4_dequantize_ref``, then timed: CUDA events around one launch into a preallocated output, median
of --reps runs after warm-up, each run preceded by a 512 MiB read that evicts L2 (and keeps the GPU
busy while the launch is queued, so host overhead is not timed). TB/s = bytes that must move (packed
weight + absmax state read, output written once) / time. Prints a markdown table and, last, a line
``BEST {json}``: the fastest bit-exact config per shape.

    python3 bench/nf4_dequant_sweep.py [--dtype bfloat16] [--elems 2048 4096 ...] [--warps 4 8 16]
        [--shapes 14336x4096 ...] [--reps 50]

Needs CUDA, torch and triton only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from whetstone_kernels.nf4 import NF4_ELEMS, NF4_PACK, NF4_WARPS, _code, block_absmax, nf4_fwd  # noqa: E402
from whetstone_kernels.nf4_ref import nf4_dequantize_ref, nf4_quantize_ref  # noqa: E402

SHAPES = ["14336x4096", "4096x14336", "4096x4096", "1024x4096"]


@triton.jit
def _baseline_kernel(Q, ABSMAX, ABSMAX2, CODE2, OFFSET, NF4, OUT, n_out, n_blocks, BLOCKSIZE: tl.constexpr,
                     BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr):
    # frozen copy of whetstone_kernels/nf4.py's kernel at commit 965c674 (the "before" of the sweep)
    blk = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    bm = blk < n_blocks
    amax = block_absmax(ABSMAX, ABSMAX2, CODE2, OFFSET, blk, bm, BLOCKSIZE2, NESTED)
    first = blk[:, None] * BLOCKSIZE + 2 * tl.arange(0, HALF)[None, :]
    b = tl.load(Q + first // 2, mask=first < n_out, other=0).to(tl.int32)
    hi = tl.load(NF4 + (b >> 4)) * amax[:, None]
    lo = tl.load(NF4 + (b & 15)) * amax[:, None]
    vals = tl.reshape(tl.join(hi, lo), [ROWS, BLOCKSIZE])
    idx = blk[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    tl.store(OUT + idx, vals.to(OUT.dtype.element_ty), mask=idx < n_out)


def baseline_fwd(packed, st, out):
    """The 965c674 launch (nested state, blocksize 64): 2048 elements per program, 4 warps."""
    n, bs = out.numel(), st.blocksize
    n_blocks, rows = -(-n // bs), 2048 // bs
    _baseline_kernel[(-(-n_blocks // rows),)](
        packed, st.absmax, st.absmax2, st.code2, st.offset, _code(packed.device), out, n, n_blocks,
        BLOCKSIZE=bs, BLOCKSIZE2=st.blocksize2, NESTED=True, ROWS=rows, HALF=bs // 2, num_warps=4,
        enable_fp_fusion=False)
    return out


def candidates(elems_list, warps_list):
    """(name, knobs, fn(packed, state, out)) for the baseline and every pack x elems x num_warps."""
    yield "baseline 965c674 (2048/4)", {"kernel": "965c674", "elems": 2048, "num_warps": 4}, baseline_fwd
    for pack in (False, True):
        for elems in elems_list:
            for warps in warps_list:
                knobs = {"pack": pack, "elems": elems, "num_warps": warps}
                name = f"{'pack' if pack else 'join'} {elems}/{warps}"
                if (pack, elems, warps) == (NF4_PACK, NF4_ELEMS, NF4_WARPS):
                    name += " (default)"
                yield name, knobs, lambda p, s, o, k=knobs: nf4_fwd(p, s, out=o, **k)


def median_us(fn, flush, reps, warmup=10):
    """Median CUDA-event time (us) of fn(), L2 evicted by reading ``flush`` before each run."""
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in ev:
        flush.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3


def copy_tbps(flush, reps) -> float:
    """The device's copy bandwidth (TB/s, bytes read + written): a 1 GiB device-to-device copy,
    timed like the candidates; the denominator of the "of copy" column."""
    src = torch.ones(256 << 20, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), flush, reps)
    return 2 * src.numel() * src.element_size() / us / 1e6


def sweep_shape(shape_s, dtype, args, flush, copy: float):
    """Check and time every candidate at one weight shape; prints table rows, returns the best exact.
    ``copy``: the device's copy bandwidth in TB/s (:func:`copy_tbps`), the "of copy" column's base."""
    shape = tuple(int(x) for x in shape_s.split("x"))
    torch.manual_seed(0)
    packed, st = nf4_quantize_ref(torch.randn(shape, device="cuda") * 0.02)
    want = nf4_dequantize_ref(packed, st, dtype)
    out = torch.empty(shape, dtype=dtype, device="cuda")
    moved = sum(t.numel() * t.element_size() for t in (packed, st.absmax, st.absmax2, st.code2, st.offset, out))
    base_us, best = None, None
    for name, knobs, fn in candidates(args.elems, args.warps):
        out.fill_(float("nan"))
        try:
            fn(packed, st, out)
        except Exception as ex:  # e.g. a tile too large to compile: report it, go on
            print(f"| {name} | {shape_s} | error: {type(ex).__name__} | | | | |", flush=True)
            continue
        exact = torch.equal(out, want)
        us = median_us(lambda: fn(packed, st, out), flush, args.reps)
        base_us = base_us or us
        tbps = moved / us / 1e6
        print(f"| {name} | {shape_s} | {'yes' if exact else 'NO'} | {us:.1f} | {tbps:.2f} | "
              f"{tbps / copy:.2f} | {base_us / us:.2f}x |", flush=True)
        if exact and (best is None or us < best["us"]):
            best = dict(knobs, config=name, us=round(us, 2), tbps=round(tbps, 3), of_copy=round(tbps / copy, 3))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="ROWSxCOLS of the weight")
    ap.add_argument("--elems", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {args.dtype}; "
          f"defaults elems={NF4_ELEMS} num_warps={NF4_WARPS} pack={NF4_PACK}")
    flush = torch.ones(128 << 20, dtype=torch.int32, device="cuda")  # 512 MiB, > L2
    copy = copy_tbps(flush, args.reps)
    print(f"COPY {copy:.3f} TB/s (1 GiB device-to-device, read + write)")
    print("\n| config | shape | exact | us | TB/s | of copy | vs baseline |\n|---|---|---|---|---|---|---|")
    best = {}
    for shape_s in args.shapes:
        best[shape_s] = sweep_shape(shape_s, dtype, args, flush, copy)
        torch.cuda.empty_cache()
    print("\nBEST " + json.dumps(best))


if __name__ == "__main__":
    main()
