"""NF4 nibbles to fp16/bf16 code values in registers, for the decode matmul (``nf4_matmul``).

``nf4_lookup(b, CODE16, ASM)`` takes packed NF4 bytes b (uint8, any shape; bitsandbytes order: the
high nibble is element 2i, the low nibble element 2i+1) and returns (hi, lo), two tensors of b's shape
in CODE16's dtype (fp16 or bf16): NF4[b >> 4] and NF4[b & 15], the 16 NF4 code values rounded to that
dtype (``CODE16`` = ``nf4_code().to(dtype)``). The absmax is not applied: the caller scales a whole
quantisation block's dot product by it (in fp32), which is why the values can be 16-bit here.

On CUDA (``ASM=True``) the table lives in registers: each 16-bit code is a low byte and a high byte,
each byte table (16 bytes) is four 32-bit words, and PTX ``prmt`` (byte permute: 4 output bytes
chosen from 8 by 3-bit selectors) looks up four nibbles at once: index bits 0-2 pick from entries
0-7 and from entries 8-15, bit 3 chooses between the two, and two more permutes interleave the low and
high bytes into two 16-bit pairs. Eight nibbles (one 32-bit word of 4 bytes, ``pack=4``) cost ~28
integer instructions and no memory access; the gather it replaces costs a load per nibble (PTX ISA,
"prmt"; the same register-table idea as llama.cpp's IQ4_NL CUDA path, written here from the ISA).
Under the Triton interpreter (``ASM=False``; inline assembly does not run there) the values come
from two gathers of CODE16: the same values.

Source: Dettmers et al. 2023, "QLoRA" (the NF4 code); NVIDIA PTX ISA 8.x, ``prmt.b32``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nf4_ref import nf4_code

_CODE16: dict = {}


def code16(device, dtype: torch.dtype) -> torch.Tensor:
    """The 16 NF4 code values in ``dtype`` (fp16/bf16) on ``device``, cached: [16]."""
    key = (device, dtype)
    if key not in _CODE16:
        _CODE16[key] = nf4_code(device).to(dtype)
    return _CODE16[key]


def _byte_words(dtype: torch.dtype) -> tuple[list[int], list[int]]:
    """The 16 codes of ``dtype`` as (low-byte table, high-byte table), each four little-endian words."""
    bits = [int(v) & 0xFFFF for v in nf4_code(torch.device("cpu")).to(dtype).view(torch.int16)]
    lo, hi = [v & 0xFF for v in bits], [v >> 8 for v in bits]

    def words(t):
        return [sum(t[4 * j + i] << (8 * i) for i in range(4)) for j in range(4)]
    return words(lo), words(hi)


def _lookup_asm(dtype: torch.dtype) -> str:
    """PTX for one packed word: $4 = 4 bytes (element e in bits 8e..8e+7); $0,$1 = the 4 high-nibble
    values (element e in half e), $2,$3 = the 4 low-nibble values."""
    lo, hi = _byte_words(dtype)
    consts = "".join(f"mov.b32 l{j}, {w:#010x};\n" for j, w in enumerate(lo)) + \
        "".join(f"mov.b32 h{j}, {w:#010x};\n" for j, w in enumerate(hi))

    def four(out0, out1):
        # t holds 4 nibbles at bits 0-3, 8-11, 16-19, 24-27 (elements 0..3); s packs them into the
        # selector's 16 bits as positions (0: e0, 1: e2, 2: e1, 3: e3); the last two permutes undo it
        return ("shr.u32 s, t, 12;\nor.b32 s, s, t;\nand.b32 s7, s, 0x7777;\n"
                "shr.u32 b3, s, 1;\nand.b32 b3, b3, 0x4444;\nor.b32 b3, b3, 0x3210;\n"
                "prmt.b32 a, l0, l1, s7;\nprmt.b32 b, l2, l3, s7;\nprmt.b32 L, a, b, b3;\n"
                "prmt.b32 a, h0, h1, s7;\nprmt.b32 b, h2, h3, s7;\nprmt.b32 H, a, b, b3;\n"
                f"prmt.b32 {out0}, L, H, 0x6240;\nprmt.b32 {out1}, L, H, 0x7351;\n")
    return ("{\n.reg .b32 t, s, s7, b3, a, b, L, H, l0, l1, l2, l3, h0, h1, h2, h3;\n" + consts +
            "shr.u32 t, $4, 4;\nand.b32 t, t, 0x0F0F0F0F;\n" + four("$0", "$1") +
            "and.b32 t, $4, 0x0F0F0F0F;\n" + four("$2", "$3") + "}")


_ASM_BF16 = tl.constexpr(_lookup_asm(torch.bfloat16))
_ASM_FP16 = tl.constexpr(_lookup_asm(torch.float16))


@triton.jit
def nf4_lookup(b, CODE16, ASM: tl.constexpr):
    """(NF4[b >> 4], NF4[b & 15]) in CODE16's element dtype (fp16/bf16), each of b's shape (b uint8)."""
    if ASM:
        if CODE16.dtype.element_ty == tl.bfloat16:
            hi, lo = tl.inline_asm_elementwise(_ASM_BF16, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        else:
            hi, lo = tl.inline_asm_elementwise(_ASM_FP16, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32)
        hi = tl.load(CODE16 + (bi >> 4))
        lo = tl.load(CODE16 + (bi & 15))
    return hi, lo
