"""whetstone_kernels.nf4_merge (W' = dequant(W_nf4) + Bs A in one pass) against an fp64 reference.

On the CPU the kernel runs under the Triton interpreter in fp32 and fp16 (bf16 dots are wrong there;
tests/gpu checks bf16 on CUDA). The merged weight is rounded once from fp32, so it must lie within
one ulp of the output dtype of the exact W + Bs A; with Bs = 0 (a fresh adapter) it is the plain
dequantisation bit for bit."""
import pytest
import torch

from whetstone_kernels.nf4 import nf4_fwd
from whetstone_kernels.nf4_merge import nf4_merged, nf4_merged_ref
from whetstone_kernels.nf4_ref import nf4_dequantize_ref, nf4_quantize_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _weight(n, k, nested=True):
    return nf4_quantize_ref(torch.randn(n, k, device=DEV) * 0.02, double_quant=nested)


def _exact(packed, st, A, Bs):
    return nf4_dequantize_ref(packed, st, torch.float32).double() + Bs.double() @ A.double()


def _assert_within_one_ulp(got, exact, dtype):
    assert got.dtype == dtype and got.shape == exact.shape
    err = (got.double() - exact).abs()
    bound = torch.finfo(dtype).eps * exact.abs() + 1e-7
    assert (err <= bound).all(), (err - bound).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,r,nested,cfg", [
    (64, 64, 16, True, None),
    (48, 320, 8, True, dict(bn=16, nb=2)),     # 5 blocks a row: the last k tile is half empty
    (100, 256, 24, False, dict(bn=32, nb=1)),  # rank padded to 32; rows not a multiple of bn
    (33, 128, 4, True, dict(bn=16, nb=4))])     # rank 4 padded to 16; 3 row tiles
def test_merged_weight_is_the_exact_sum_rounded_once(dtype, n, k, r, nested, cfg):
    packed, st = _weight(n, k, nested)
    A = (torch.randn(r, k, device=DEV) * 0.05).to(dtype)
    Bs = (torch.randn(n, r, device=DEV) * 0.05).to(dtype)
    got = nf4_merged(packed, st, A, Bs, dtype, **(cfg or {}))
    _assert_within_one_ulp(got, _exact(packed, st, A, Bs), dtype)
    _assert_within_one_ulp(nf4_merged_ref(packed, st, A, Bs, dtype), _exact(packed, st, A, Bs), dtype)
    assert torch.equal(got, nf4_merged(packed, st, A, Bs, dtype, **(cfg or {})))  # deterministic


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fresh_adapter_gives_the_plain_dequantisation_bit_for_bit(dtype):
    packed, st = _weight(80, 192)
    A = torch.randn(16, 192, device=DEV).to(dtype)
    got = nf4_merged(packed, st, A, torch.zeros(80, 16, device=DEV, dtype=dtype), dtype, bn=16, nb=1)
    assert torch.equal(got, nf4_fwd(packed, st, dtype))


def test_strided_lora_factors_slices_of_stacked_adapters():
    """A as a row slice of the group's stacked [A_q; A_k; A_v] (the engine's CastCache)."""
    packed, st = _weight(32, 128)
    stacked = torch.randn(48, 128, device=DEV) * 0.05
    A, Bs = stacked[16:32], torch.randn(32, 16, device=DEV) * 0.05
    got = nf4_merged(packed, st, A, Bs, torch.float32, bn=16, nb=1)
    _assert_within_one_ulp(got, _exact(packed, st, A, Bs), torch.float32)


def test_bad_inputs_are_refused_naming_the_problem():
    packed, st = _weight(32, 128)
    A, Bs = torch.randn(8, 128, device=DEV), torch.randn(32, 8, device=DEV)
    with pytest.raises(ValueError, match=r"A \[r, 128\] and Bs \[32, r\]"):
        nf4_merged(packed, st, A[:, :64], Bs, torch.float32)
    with pytest.raises(ValueError, match="share one of"):
        nf4_merged(packed, st, A.half(), Bs, torch.float32)
    with pytest.raises(ValueError, match="rank up to 128"):
        nf4_merged(packed, st, torch.randn(130, 128, device=DEV), torch.randn(32, 130, device=DEV), torch.float32)
    with pytest.raises(ValueError, match="impl"):
        nf4_merged(packed, st, A, Bs, torch.float32, impl="cuda")
    odd_packed, odd_st = _weight(4, 96)
    with pytest.raises(ValueError, match=r"in_features \(96\) to be a multiple of the blocksize \(64\)"):
        nf4_merged(odd_packed, odd_st, torch.randn(8, 96, device=DEV), torch.randn(4, 8, device=DEV), torch.float32)
