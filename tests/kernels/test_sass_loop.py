"""bench/sass_loop.py: the decode kernels compiled offline for sm_90 (no GPU), their hot loops read.

What the register table changed, held as a property of the machine code: the NF4 matmul's loop
looks each nibble up with byte permutes (PRMT) and loads no table from memory (the gather version
issued a load per nibble, 64+ a thread a trip), and multiplies on tensor cores (HGMMA); the decode
attention's loop runs its two dots on tensor cores and copies K/V ahead asynchronously. The script
runs in its own process (the test session runs kernels under the interpreter)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loop(*args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sass_loop.py"), *args],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_nf4_matmul_loop_looks_up_in_registers():
    r = _loop("nf4_matmul", "--block-n", "128", "--block-k", "128", "--stages", "3")
    ops, per_thread = r["ops"], r["work"] // r["threads"]  # 128 weights = 16 packed words a thread a trip
    assert ops.get("HGMMA", 0) >= 8, ops
    assert ops.get("PRMT", 0) >= per_thread, ops  # 16 permutes a word (8 nibbles): 2 a weight
    assert ops.get("LDG", 0) <= 8, ops  # the absmax only: no table loads
    assert r["instructions"] < 10 * per_thread, r["instructions"]


def test_decode_attention_loop_uses_tensor_cores_and_async_copies():
    ops = _loop("decode_attention", "--stages", "2")["ops"]
    assert ops.get("HMMA", 0) > 0 and ops.get("LDGSTS", 0) > 0, ops
