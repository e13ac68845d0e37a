import os

import pytest
import torch

from whetstone_kernels.nf4 import nf4_bwd, nf4_dequantize, nf4_fwd, nf4_linear
from whetstone_kernels.nf4_ref import (NF4_CODE, dynamic_map_signed, nf4_dequantize_ref, nf4_linear_ref, nf4_quantize_ref,
                             nf4_state_from_bnb)


def _bnb():
    try:
        import bitsandbytes.functional as F
    except Exception:  # pragma: no cover - bitsandbytes absent or unusable here
        pytest.skip("bitsandbytes not available")
    try:
        q, st = F.quantize_4bit(torch.randn(64, 64), blocksize=64, compress_statistics=True, quant_type="nf4")
        F.dequantize_4bit(q, st)
    except Exception as e:  # pragma: no cover
        pytest.skip(f"bitsandbytes cannot run on this device: {e}")
    return F


def _assert_bit_exact(got, want):
    """Bit-exact, except that the Triton interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to
    nearest even, and tests/gpu checks bit-exactness there): allow one bf16 ulp under the interpreter."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert ((got.float() - want.float()).abs() <= ulp).all()
    else:
        assert torch.equal(got, want)


def test_ref_roundtrip_error_is_within_half_a_level():
    w = torch.randn(33, 70)
    packed, st = nf4_quantize_ref(w, double_quant=False)
    d = nf4_dequantize_ref(packed, st)
    gaps = torch.tensor(NF4_CODE).diff().max().item()
    blocks = torch.nn.functional.pad(w.flatten(), (0, (-w.numel()) % 64)).view(-1, 64).abs().amax(1)
    bound = (blocks.repeat_interleave(64)[: w.numel()] * gaps / 2).view_as(w)
    assert ((d - w).abs() <= bound + 1e-6).all()


def test_ref_codes_match_bitsandbytes():
    F = _bnb()
    assert torch.equal(dynamic_map_signed(), F.create_dynamic_map(signed=True).float())
    assert torch.equal(torch.tensor(NF4_CODE), F.get_4bit_type("nf4", device="cpu").float())


# bitsandbytes 0.50.2's CPU (AVX) dequantize_4bit disagrees with bitsandbytes' own generic
# implementation (and with the CUDA kernel's flat-block format) when the last dim is even but not a
# multiple of 64, e.g. (96, 160); model weights (4096, 14336, ...) are multiples of 64. Those shapes are
# checked against the generic path below and against the CUDA kernel in tests/gpu.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 64), (37, 130), (300, 257), (96, 192)])
def test_ref_bit_exact_with_bitsandbytes(dtype, shape):
    F = _bnb()
    w = torch.randn(shape, dtype=dtype) * 0.02
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    want = F.dequantize_4bit(packed, qs)
    got = nf4_dequantize_ref(packed, nf4_state_from_bnb(qs))
    assert got.dtype == want.dtype and torch.equal(got, want)
    # our quantiser makes (almost) the same packed nibbles; its absmax codes may pick the neighbouring
    # level (bitsandbytes' search and fp32 division order differ slightly from nearest-by-midpoint)
    p2, st2 = nf4_quantize_ref(w)
    assert (p2 != packed).float().mean() < 1e-3
    assert ((st2.absmax.int() - qs.absmax.int()).abs() <= 1).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,double", [((64, 64), True), ((5, 77), True), ((3, 1000), False), ((129, 300), True)])
def test_triton_bit_exact_with_reference(dtype, shape, double):
    w = torch.randn(shape) * 0.05
    packed, st = nf4_quantize_ref(w.to(dtype), double_quant=double)
    want = nf4_dequantize_ref(packed, st)
    out = torch.full(shape, float("nan"), dtype=dtype)
    got = nf4_fwd(packed, st, out=out)
    _assert_bit_exact(got, want)
    assert torch.equal(nf4_dequantize(packed, st, impl="reference"), want)


# n odd, n not a multiple of 64 (partial last block), two nested absmax2 groups (37 x 450: 261 blocks)
STORE_SHAPES = [(1,), (3,), (3, 5), (2, 33), (7, 9), (5, 77), (37, 450)]


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("double", [True, False])
@pytest.mark.parametrize("shape", STORE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_store_paths_bit_exact_and_in_bounds(dtype, shape, double, pack):
    """Word-packed and interleaved stores, several tile sizes / num_warps: same bits as the reference,
    nothing written past the output (a sentinel tail after it stays NaN)."""
    packed, st = nf4_quantize_ref((torch.randn(shape) * 0.05).to(dtype), double_quant=double)
    want = nf4_dequantize_ref(packed, st)
    n = want.numel()
    for elems, warps in [(128, 1), (1024, 4), (None, None)]:
        buf = torch.full((n + 8,), float("nan"), dtype=dtype)
        out = buf[:n].view(shape)
        got = nf4_fwd(packed, st, out=out, elems=elems, num_warps=warps, pack=pack)
        assert got.data_ptr() == buf.data_ptr()
        _assert_bit_exact(got, want)
        assert buf[n:].isnan().all()


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("blocksize", [2, 32, 128, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_other_blocksizes(dtype, blocksize, pack):
    for shape in [(5, 77), (3, 1000)]:
        packed, st = nf4_quantize_ref((torch.randn(shape) * 0.05).to(dtype), blocksize=blocksize)
        for elems in [64, 8192]:  # fewer elements than a block: one block per program
            _assert_bit_exact(nf4_fwd(packed, st, elems=elems, pack=pack), nf4_dequantize_ref(packed, st))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_misaligned_out_takes_interleaved_store(dtype):
    """An ``out`` starting one element into its storage cannot take word stores; asked to pack, it still
    gets the right values, and its neighbours are untouched."""
    packed, st = nf4_quantize_ref((torch.randn(6, 35) * 0.05).to(dtype))
    buf = torch.full((6 * 35 + 2,), float("nan"), dtype=dtype)
    got = nf4_fwd(packed, st, out=buf[1:-1].view(6, 35), pack=True, elems=64)
    _assert_bit_exact(got, nf4_dequantize_ref(packed, st))
    assert buf[0].isnan() and buf[-1].isnan()


def test_triton_rejects_bad_tile():
    packed, st = nf4_quantize_ref(torch.randn(4, 64))
    with pytest.raises(ValueError):
        nf4_fwd(packed, st, elems=1000)


@pytest.mark.parametrize("shape", [(96, 160), (64, 96)])
def test_ref_bit_exact_with_bitsandbytes_generic_path(shape):
    F = _bnb()
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    w = torch.randn(shape, dtype=torch.bfloat16)
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    want = _dequantize_4bit_compute(packed.reshape(-1), absmax, qs.code, 64, shape, torch.bfloat16)
    assert torch.equal(nf4_dequantize_ref(packed, nf4_state_from_bnb(qs)), want)


def test_triton_bit_exact_with_bitsandbytes_state():
    F = _bnb()
    w = torch.randn(96, 192, dtype=torch.bfloat16)
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    _assert_bit_exact(nf4_dequantize(packed, qs), F.dequantize_4bit(packed, qs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_autograd_matches_reference(dtype):
    packed, st = nf4_quantize_ref(torch.randn(24, 40))
    x = torch.randn(3, 5, 40, dtype=dtype, requires_grad=True)
    bias = torch.randn(24, dtype=dtype, requires_grad=True)
    y = nf4_linear(x, packed, st, bias)
    yr = nf4_linear(x, packed, st, bias, impl="reference")
    torch.testing.assert_close(y, yr)
    dy = torch.randn_like(y)
    a = torch.autograd.grad(y, (x, bias), dy)
    b = torch.autograd.grad(yr, (x, bias), dy)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(nf4_bwd(dy, packed, st), dy @ nf4_dequantize_ref(packed, st, dtype))


def test_ref_linear_gradcheck():
    packed, st = nf4_quantize_ref(torch.randn(6, 8))
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: nf4_linear_ref(a, packed, st), (x,))
