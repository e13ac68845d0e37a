"""whetstone_kernels.decode_attention on CUDA: bf16/fp16 at Llama-3.1-8B's decode shapes against
fp64, and one captured CUDA graph replayed while the device-side column grows (CUDA only)."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.kernels.test_decode_attention import _case, _want  # noqa: E402
from whetstone_kernels.decode_attention import decode_attention  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,col,split", [(16, 1535, None), (1, 3000, None), (4, 700, 1), (16, 63, None)])
def test_llama8b_shapes(dtype, B, col, split):
    L = 4096 if B == 1 else 2048
    pads = [(7 * b) % 300 % (col + 1) for b in range(B)]
    q, k, v, valid, c = _case(B, 32, 8, L, 128, dtype, col, pads, seed=B)
    got = decode_attention(q, k, v, valid, c, 128 ** -0.5, split=split)
    want = _want(q, k, v, valid, c, 128 ** -0.5)
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 3e-3), err


def test_graph_replay_follows_the_column():
    B, L = 8, 1024
    q, k, v, valid, c = _case(B, 32, 8, L, 128, torch.bfloat16, L - 1, [0] * B)
    k = k.nan_to_num(0.0)
    v = v.nan_to_num(0.0)
    col = torch.zeros(1, dtype=torch.long, device="cuda")
    vm = torch.zeros_like(valid)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode_attention(q, k, v, vm, col, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = decode_attention(q, k, v, vm, col, 0.1)
    for t in (0, 5, 64, 500, L - 1):
        col.fill_(t)
        vm.zero_()
        vm[:, :t + 1] = True
        g.replay()
        want = _want(q, k, v, vm, col.cpu(), 0.1)
        assert (out.double() - want).abs().max().item() < 2e-2, t
