"""whetstone_kernels.nf4_lut: the NF4 code table of the decode matmul, as bytes and as values.

The PTX register table is built from two byte tables (low and high byte of each 16-bit code, four
little-endian words each); here every entry is read back from those words and compared with the
code rounded to fp16/bf16, and the interpreter's lookup (ASM=False, two gathers) is run over all
256 byte values. The PTX lookup itself (ASM=True) runs on CUDA only: tests/gpu/test_nf4_lut_gpu.py."""
import pytest
import torch
import triton
import triton.language as tl

from whetstone_kernels.nf4_lut import _byte_words, code16, nf4_lookup
from whetstone_kernels.nf4_ref import nf4_code

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_byte_words_hold_each_code(dtype):
    lo, hi = _byte_words(dtype)
    assert len(lo) == len(hi) == 4 and all(0 <= w < 1 << 32 for w in lo + hi)
    want = nf4_code(torch.device("cpu")).to(dtype)
    for i in range(16):
        bits = ((lo[i // 4] >> (8 * (i % 4))) & 0xFF) | (((hi[i // 4] >> (8 * (i % 4))) & 0xFF) << 8)
        got = torch.tensor([bits - (1 << 16) if bits >= 1 << 15 else bits], dtype=torch.int16).view(dtype)
        assert got.item() == want[i].item(), (i, hex(bits))
    assert code16(torch.device("cpu"), dtype).tolist() == want.tolist()


@triton.jit
def _lookup_kernel(B, CODE16, HI, LO, ASM: tl.constexpr):
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    hi, lo = nf4_lookup(tl.load(B + offs), CODE16, ASM)
    tl.store(HI + offs, hi)
    tl.store(LO + offs, lo)


def lookup_all_bytes(dtype, asm: bool):
    """(hi, lo) of nf4_lookup over the 256 byte values (row-major [16, 16]), and the bytes."""
    b = torch.arange(256, device=DEV, dtype=torch.int32).to(torch.uint8)
    hi = torch.empty(256, device=DEV, dtype=dtype)
    lo = torch.empty_like(hi)
    _lookup_kernel[(1,)](b, code16(b.device, dtype), hi, lo, ASM=asm)
    return hi, lo, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interpreter_lookup_every_byte(dtype):
    hi, lo, b = lookup_all_bytes(dtype, asm=False)
    code = nf4_code(b.device).to(dtype)
    assert torch.equal(hi, code[(b >> 4).long()]) and torch.equal(lo, code[(b & 15).long()])
