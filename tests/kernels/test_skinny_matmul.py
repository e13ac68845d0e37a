"""whetstone_kernels.skinny_matmul (x A^T for few rows, one launch) against x @ A^T.

On the CPU the kernel runs under the Triton interpreter (fp32 and fp16; bf16 dots are wrong there
and are checked on CUDA in tests/gpu). Split-K partials are summed in fixed order: two calls give
the same bits."""
import pytest
import torch

from whetstone_kernels.skinny_matmul import pick_config, skinny_matmul
from tests.kernels.kernel_test_util import assert_close_lowp

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,r,k,cfg", [
    (1, 16, 256, None), (3, 48, 320, None), (16, 32, 512, None), (17, 24, 200, None),
    (5, 80, 256, dict(BLOCK_M=16, BLOCK_R=32, BLOCK_K=64, SPLIT_K=3)),  # 3 R tiles, uneven splits
    (40, 8, 128, dict(BLOCK_M=32, BLOCK_R=16, BLOCK_K=32, SPLIT_K=1))])  # 2 M tiles, no split
def test_matches_reference(dtype, m, r, k, cfg):
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    A = torch.randn(r, k, device=DEV, dtype=dtype) * 0.1
    cfg = cfg and dict(cfg, num_warps=4, num_stages=1)
    with torch.no_grad():
        got = skinny_matmul(x, A, config=cfg)
        again = skinny_matmul(x, A, config=cfg)
    want = x.double() @ A.double().t()
    assert got.shape == (m, r) and got.dtype == dtype
    assert_close_lowp(got, want.to(dtype), dtype)
    assert torch.equal(got, again)


def test_strided_inputs_and_a_column_block_of_stacked_a():
    """x a row slice of a wider buffer, A a slice of stacked adapters (the decoder's q/k/v A)."""
    wide = torch.randn(4, 300, device=DEV)
    stacked = torch.randn(40, 256, device=DEV)
    x, A = wide[:, 10:266], stacked[8:32]
    got = skinny_matmul(x, A)
    torch.testing.assert_close(got, x @ A.t(), rtol=1e-5, atol=1e-5)


def test_split_k_is_chosen_for_long_k_and_kept_within_the_chunks():
    cfg = pick_config(16, 48, 4096, torch.device("cpu"))
    assert cfg["SPLIT_K"] > 1 and -(-4096 // cfg["BLOCK_K"]) // cfg["SPLIT_K"] >= 2
    assert pick_config(16, 48, 64, torch.device("cpu"))["SPLIT_K"] == 1  # one chunk: nothing to split


def test_bad_shapes_and_dtypes_are_refused():
    x = torch.randn(2, 64, device=DEV)
    with pytest.raises(ValueError, match=r"x \[M, K\] and A \[R, K\]"):
        skinny_matmul(x, torch.randn(8, 32, device=DEV))
    with pytest.raises(ValueError, match="share one of"):
        skinny_matmul(x, torch.randn(8, 64, device=DEV).half())
    with pytest.raises(ValueError, match="impl"):
        skinny_matmul(x, torch.randn(8, 64, device=DEV), impl="cuda")
    assert skinny_matmul(x[:0], torch.randn(8, 64, device=DEV)).shape == (0, 8)
    A = torch.randn(8, 64, device=DEV)
    assert torch.equal(skinny_matmul(x, A, impl="reference"), x @ A.t())
