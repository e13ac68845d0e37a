"""whetstone_kernels.nf4_matmul (fused NF4 decode matmul) against x @ nf4_dequantize_ref(W)^T.

On the CPU the kernel runs under the Triton interpreter, where tl.dot is right in fp32/fp16 but not in
bf16: bf16 is checked on CUDA only (here and in tests/gpu). Shapes are small (the interpreter is slow).
Several fp32 rows: the kernel dequantises W exactly as the reference, so only the accumulation order
differs (fp32 throughout, split-K partials summed in fixed order). Several fp16/bf16 rows: the code
values are rounded to x's dtype and each block's absmax scales its dot (nf4_lut), so W differs at x's
rounding level. One row: W's values are not rounded to x's dtype before the fp32 FMAs, so they differ
at x's rounding level."""
import os

import pytest
import torch

from whetstone_kernels.nf4_matmul import nf4_matmul, nf4_matmul_fwd, pick_config
from whetstone_kernels.nf4_ref import nf4_dequantize_ref, nf4_quantize_ref, nf4_state_from_bnb
from tests.kernels.kernel_test_util import assert_close_lowp

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _weight(n, k, nested=True, blocksize=64):
    return nf4_quantize_ref(torch.randn(n, k, device=DEV) * 0.05, blocksize=blocksize, double_quant=nested)


def _check(x, packed, st, bias=None, config=None):
    with torch.no_grad():
        got = nf4_matmul(x, packed, st, bias, config=config)
        want = nf4_matmul(x, packed, st, bias, impl="reference")
    assert got.shape == want.shape == (*x.shape[:-1], st.shape[0]) and got.dtype == x.dtype
    assert_close_lowp(got, want, x.dtype)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,nested,bias", [
    (1, 72, 64, True, False), (1, 40, 128, False, True), (3, 200, 320, True, True), (8, 72, 320, False, False),
    (16, 40, 128, False, True), (17, 72, 192, True, False), (33, 24, 64, True, True)])
def test_matches_reference(dtype, m, n, k, nested, bias):
    packed, st = _weight(n, k, nested)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    b = torch.randn(n, device=DEV, dtype=dtype) if bias else None
    _check(x, packed, st, b)


# explicit configs: split-K with an uneven last split, several absmax blocks per K chunk (NB > 1),
# a K chunk inside one absmax block (blocksize 128 > BLOCK_K 64), M over one M tile, one-row tiles
# (BLOCK_M 1: CUDA-core FMAs) over several rows and with a K chunk inside one absmax block, two K
# chunks sharing one absmax block
@pytest.mark.parametrize("m,n,k,blocksize,cfg", [
    (5, 72, 640, 64, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=3)),
    (2, 40, 384, 128, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),
    (20, 48, 256, 64, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=4)),
    (4, 33, 192, 32, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1)),
    (3, 40, 256, 64, dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, SPLIT_K=2)),
    (1, 40, 384, 128, dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),
    (2, 24, 512, 256, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=2))])
def test_configs(m, n, k, blocksize, cfg):
    packed, st = _weight(n, k, True, blocksize)
    x = torch.randn(m, k, device=DEV)
    b = torch.randn(n, device=DEV)
    a = _check(x, packed, st, b, dict(cfg, num_warps=4, num_stages=1))
    # deterministic: split-K partials are summed in fixed order, whichever program finishes last
    assert torch.equal(a, nf4_matmul(x, packed, st, b, config=dict(cfg, num_warps=4, num_stages=1)))


def test_leading_dims_and_noncontiguous_x():
    packed, st = _weight(24, 128)
    x = torch.randn(2, 3, 256, device=DEV)[..., ::2]  # [2, 3, 128], stride 2
    y = _check(x, packed, st)
    assert y.shape == (2, 3, 24)


def test_default_config_uses_split_k():
    cfg = pick_config(8, 72, 2048, 64, torch.device(DEV))
    assert cfg["BLOCK_M"] == 16 and cfg["SPLIT_K"] > 1
    # one fp32 row takes the CUDA-core FMA path; two rows and more the tensor-core tiles
    assert [pick_config(m, 72, 320, 64, torch.device(DEV), torch.float32)["BLOCK_M"] for m in (1, 2, 17, 33, 63)] \
        == [1, 16, 32, 64, 64]
    # one fp16/bf16 row: the register-table tiles on a GPU, the FMA path under the interpreter
    one = pick_config(1, 72, 320, 64, torch.device(DEV), torch.bfloat16)["BLOCK_M"]
    assert one == (16 if DEV == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" else 1)


def test_bitsandbytes_state():
    try:
        import bitsandbytes.functional as F

        w = torch.randn(40, 128, device=DEV)
        packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    except Exception as e:  # pragma: no cover - absent, or no backend for this device
        pytest.skip(f"bitsandbytes unusable here: {e!r}")
    x = torch.randn(3, 128, device=DEV)
    with torch.no_grad():
        got = nf4_matmul(x, packed, qs)
    want = x @ nf4_dequantize_ref(packed, nf4_state_from_bnb(qs), torch.float32).t()
    assert_close_lowp(got, want, torch.float32)


def test_k_not_multiple_of_blocksize_raises():
    packed, st = nf4_quantize_ref(torch.randn(8, 96, device=DEV))
    with pytest.raises(ValueError, match=r"\(8, 96\)"):
        nf4_matmul(torch.randn(2, 96, device=DEV), packed, st)


def test_bad_inputs_raise():
    packed, st = _weight(8, 64)
    with pytest.raises(ValueError, match="K=64"):
        nf4_matmul(torch.randn(2, 128, device=DEV), packed, st)
    with pytest.raises(ValueError, match="bias"):
        nf4_matmul(torch.randn(2, 64, device=DEV), packed, st, torch.randn(9, device=DEV))
    with pytest.raises(ValueError, match="impl"):
        nf4_matmul(torch.randn(2, 64, device=DEV), packed, st, impl="cuda")


def test_forward_only():
    packed, st = _weight(8, 64)
    x = torch.randn(2, 64, device=DEV, requires_grad=True)
    with pytest.raises(RuntimeError, match="forward-only"):
        nf4_matmul(x, packed, st)
    with torch.no_grad():  # decode runs under no_grad: fine even for a leaf that requires grad
        assert nf4_matmul(x, packed, st).shape == (2, 8)


def test_empty_rows():
    packed, st = _weight(8, 64)
    assert nf4_matmul(torch.randn(0, 64, device=DEV), packed, st).shape == (0, 8)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="tl.dot in bf16 is wrong under the interpreter")
def test_bf16_on_device():
    packed, st = _weight(200, 320)
    _check(torch.randn(8, 320, device=DEV, dtype=torch.bfloat16), packed, st)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,r,cfg", [
    (1, 40, 256, 16, None), (3, 72, 320, 8, None),
    (5, 40, 512, 16, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=2)),
    (1, 24, 256, 4, dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, SPLIT_K=3)),
    (1, 40, 128, 24, None), (4, 24, 128, 20, None)])
def test_lora_term_in_the_epilogue(dtype, m, n, k, r, cfg):
    """y = x W^T + b + s (x A^T) B^T with xa a column slice of a wider product (as the decoder's
    shared q/k/v A GEMM gives it), with and without split-K, r below the padded 16 and above it
    (24, 20: masked to 32), one row and several."""
    packed, st = _weight(n, k)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    b = torch.randn(n, device=DEV, dtype=dtype)
    wide = torch.randn(m, r + 5, device=DEV, dtype=dtype)
    xa, B = wide[:, 3:3 + r], torch.randn(n, r, device=DEV, dtype=dtype)
    cfg = cfg and dict(cfg, num_warps=4, num_stages=1)
    with torch.no_grad():
        got = nf4_matmul(x, packed, st, b, config=cfg, lora=(xa, B, 0.5))
        want = nf4_matmul(x, packed, st, b, impl="reference") + 0.5 * (xa @ B.t())
        without = nf4_matmul(x, packed, st, b, config=cfg)
        ref = nf4_matmul(x, packed, st, b, impl="reference", lora=(xa, B, 0.5))
    assert torch.equal(ref, want)  # the reference adds the same term
    assert_close_lowp(got, want, dtype)
    assert not torch.allclose(got, without)  # the term is there


def test_lora_with_leading_dims():
    """x [2, 3, K] (a batch of sequences): xa holds the flattened rows, [6, r]; y [2, 3, N]."""
    packed, st = _weight(24, 128)
    x = torch.randn(2, 3, 128, device=DEV)
    xa, B = torch.randn(6, 8, device=DEV), torch.randn(24, 8, device=DEV)
    with torch.no_grad():
        got = nf4_matmul(x, packed, st, lora=(xa, B, 2.0))
        want = nf4_matmul(x, packed, st, impl="reference") + 2.0 * (xa @ B.t()).view(2, 3, 24)
    assert got.shape == (2, 3, 24)
    assert_close_lowp(got, want, torch.float32)
    with pytest.raises(ValueError, match=r"lora needs xa \[6, r\]"):
        nf4_matmul(x, packed, st, lora=(xa[:3], B, 2.0))


def test_lora_shapes_are_checked():
    packed, st = _weight(24, 128)
    x = torch.randn(2, 128, device=DEV)
    with pytest.raises(ValueError, match="lora needs xa"):
        nf4_matmul(x, packed, st, lora=(torch.randn(3, 8, device=DEV), torch.randn(24, 8, device=DEV), 1.0))
    with pytest.raises(ValueError, match="dtype"):
        nf4_matmul(x, packed, st, lora=(torch.randn(2, 8, device=DEV).half(), torch.randn(24, 8, device=DEV), 1.0))
