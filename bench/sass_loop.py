"""Offline SASS of a Whetstone Triton kernel for an H100/H200 (sm_90), on a machine with no GPU.

Compiles the kernel with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` (pointer arguments
and the integer sizes marked divisible by 16, as Triton specialises them at a real launch), reads
the cubin back with the ``cuobjdump`` that ships with Triton, finds the longest loop (the largest
backward branch) and counts its instructions by opcode. Instructions per weight (or per key) in
the hot loop (per thread: the loop body once; per unit: summed over a program's threads) is what bounded the NF4 decode matmul (bench/RESULTS.md, sessions 19 and 21); this
shows the effect of a kernel change before any device time is spent.

    python3 bench/sass_loop.py nf4_matmul [--block-n 128] [--stages 3] [--m 16]
    python3 bench/sass_loop.py decode_attention
    python3 bench/sass_loop.py nf4_matmul --dump /tmp/k     # also writes k.ttgir, k.ptx, k.sass

Prints the loop's address range, its instruction count, the count per unit of work, and the opcode
histogram. Needs only triton (and its bundled cuobjdump); torch is imported by the kernel modules. Not under
``TRITON_INTERPRET=1`` (the interpreter's kernels do not compile): the script switches it off.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile real kernels


def _nf4_matmul(a):
    mod = importlib.import_module("whetstone_kernels.nf4_matmul")
    fn = mod._nf4_matmul_kernel
    ptrs = dict(X="*bf16", Q="*u8", ABSMAX="*u8", ABSMAX2="*fp32", CODE2="*fp32", OFFSET="*fp32", CODE="*fp32",
                CODE16="*bf16", BIAS="*bf16", Y="*bf16", PART="*fp32", LOCKS="*i32", XA="*bf16", LB="*bf16")
    bm = 16 if a.m <= 16 else 32 if a.m <= 32 else 64
    consts = dict(BLOCKSIZE=64, BLOCKSIZE2=256, NESTED=True, HAS_BIAS=False, SPLIT=True, BLOCK_M=bm,
                  BLOCK_N=a.block_n, BLOCK_K=a.block_k, NB=max(a.block_k // 64, 1), IEEE=False, HAS_LORA=False,
                  R=16, LUT=True, ASM=True)
    floats = {"lora_scale"}
    return fn, ptrs, consts, floats, a.block_n * a.block_k, "weight"  # weights a program takes per trip


def _decode_attention(a):
    mod = importlib.import_module("whetstone_kernels.decode_attention")
    fn = mod._decode_attn_kernel
    ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", VALID="*u8", COL="*i64", O="*bf16", PO="*fp32", PL="*fp32")
    consts = dict(G=4, GP=16, D=128, DP=128, BLOCK_L=64, SPLIT=2, IEEE=False)
    return fn, ptrs, consts, {"scale"}, consts["BLOCK_L"], "key (4 query heads)"  # keys per trip


KERNELS = {"nf4_matmul": _nf4_matmul, "decode_attention": _decode_attention}


def compile_sass(fn, ptrs, consts, floats, warps, stages):
    """(sass text, compiled kernel) of ``fn`` for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: ptrs[n] if n in ptrs else "constexpr" if n in consts else "fp32" if n in floats else "i32"
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] != "constexpr"
             and sig[n] != "fp32" and n not in ("split_k", "r", "Hk")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return sass, k


def longest_loop(sass: str):
    """(start, end, [instruction text]) of the largest backward branch's body."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)]
    best = None
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and (best is None or addr - int(m.group(1), 16) > best[1] - best[0]):
            best = (int(m.group(1), 16), addr)
    if best is None:
        return None
    return best[0], best[1], [t for a, t in ins if best[0] <= a <= best[1]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--dump")
    a = ap.parse_args()
    fn, ptrs, consts, floats, work, unit = KERNELS[a.kernel](a)
    sass, k = compile_sass(fn, ptrs, consts, floats, a.warps, a.stages)
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(a.dump, f"k.{ext}"), "w") as f:
                f.write(k.asm[ext])
        with open(os.path.join(a.dump, "k.sass"), "w") as f:
            f.write(sass)
    loop = longest_loop(sass)
    if loop is None:
        print("no loop found")
        return
    lo, hi, body = loop
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    print(f"{a.kernel} {consts}, {a.warps} warps, {a.stages} stages: loop {lo:#x}..{hi:#x}, {len(body)} "
          f"instructions a thread, {len(body) * a.warps * 32 / work:.2f} thread-instructions per {unit}, "
          f"shared memory {k.metadata.shared} B")
    print(" ".join(f"{op}:{n}" for op, n in ops.most_common()))
    print("RESULT " + json.dumps(dict(kernel=a.kernel, instructions=len(body), work=work,
                                      threads=a.warps * 32, ops=dict(ops))))


if __name__ == "__main__":
    main()
