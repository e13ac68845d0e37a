"""whetstone_kernels.decode_attention against the eager attention of one query per row.

The reference is the decoder's former eager path written out in fp64: scores over the cache
columns written so far (<= col), left-padding keys masked, softmax, times V. The kernel runs under
the Triton interpreter on the CPU (fp32 and fp16; tl.dot in bf16 is wrong there, bf16 is checked in
tests/gpu). Grouped heads (G = 1, 4, 5), head dims that are and are not powers of two, one slice
and several (flash-decoding merge), slices that hold no written column, and a row whose padding
fills whole key blocks."""
import pytest
import torch

from whetstone_kernels.decode_attention import decode_attention, pick_split

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, Hq, Hk, L, D, dtype, col, pads, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(DEV, dtype)
    k = torch.randn(B, Hk, L, D, generator=g).to(DEV, dtype)
    v = torch.randn(B, Hk, L, D, generator=g).to(DEV, dtype)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate(pads):
        valid[b, p:col + 1] = True
    # columns after col hold garbage the kernel must not read (NaN would poison any read)
    k[:, :, col + 1:] = float("nan")
    v[:, :, col + 1:] = float("nan")
    return q, k, v, valid.to(DEV), torch.tensor([col], device=DEV)


def _want(q, k, v, valid, col, scale):
    n = int(col[0]) + 1
    B, Hq, D = q.shape
    Hk = k.shape[1]
    qg = q.double().reshape(B, Hk, Hq // Hk, D)
    s = (qg @ k[:, :, :n].double().transpose(-1, -2)) * scale
    s = s.masked_fill(~valid[:, None, None, :n], float("-inf"))
    return (torch.softmax(s, -1) @ v[:, :, :n].double()).reshape(B, Hq, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,Hq,Hk,L,D,col,pads,split", [
    (2, 8, 2, 200, 32, 150, [0, 37], None),
    (3, 4, 4, 96, 24, 95, [5, 0, 70], 1),
    (1, 10, 2, 300, 16, 17, [3], 4),         # col inside the first slice: later slices read nothing
    (2, 8, 2, 256, 64, 255, [130, 0], 8),    # padding fills two whole blocks of row 0
])
def test_matches_eager(dtype, B, Hq, Hk, L, D, col, pads, split):
    q, k, v, valid, c = _case(B, Hq, Hk, L, D, dtype, col, pads)
    scale = D ** -0.5
    got = decode_attention(q, k, v, valid, c, scale, split=split)
    want = _want(q, k, v, valid, c, scale)
    assert got.shape == (B, Hq, D) and got.dtype == dtype and torch.isfinite(got).all()
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    ref = decode_attention(q, k, v, valid, c, scale, impl="reference")
    torch.testing.assert_close(ref.double(), want, atol=tol, rtol=tol)


def test_split_choice_and_bad_inputs():
    dev = torch.device(DEV)
    # few (row, kv head) pairs: the keys are sliced until the GPU (here num_sms) has 2 programs per SM
    assert pick_split(1, 1, 4096, 64, dev) > 1 == pick_split(64, 8, 4096, 64, dev)
    assert pick_split(1, 8, 64, 64, dev) == 1  # too few columns to slice
    q, k, v, valid, c = _case(1, 4, 2, 64, 16, torch.float32, 10, [0])
    with pytest.raises(ValueError, match="valid must be bool"):
        decode_attention(q, k, v, valid.long(), c, 0.25)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q[:, :3], k, v, valid, c, 0.25)
    with pytest.raises(ValueError, match="share one of"):
        decode_attention(q.half(), k, v, valid, c, 0.25)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, k, v, valid, c, 0.25, split=3)
    # a valid map that is a column slice of a wider one (stride 2) gives the same result
    wide = torch.stack([valid, ~valid], -1).reshape(1, -1)[:, ::2]
    assert wide.stride(1) == 2 and torch.equal(wide, valid)
    torch.testing.assert_close(decode_attention(q, k, v, wide, c, 0.25), decode_attention(q, k, v, valid, c, 0.25))
