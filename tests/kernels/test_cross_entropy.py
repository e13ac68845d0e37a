import pytest
import torch
import torch.nn.functional as F

from whetstone_kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_fwd
from whetstone_kernels.cross_entropy_ref import linear_cross_entropy_ref

from kernel_test_util import assert_close_lowp


def _labels(t, v, n_ignore):
    y = torch.randint(0, v, (t,))
    y[torch.randperm(t)[:n_ignore]] = -100
    return y


def _naive(h, w, y, cap=None):
    total, n = 0.0, 0
    for i in range(h.shape[0]):
        if y[i] == -100:
            continue
        z = h[i] @ w.t()
        if cap:
            z = cap * torch.tanh(z / cap)
        total = total + torch.logsumexp(z, 0) - z[y[i]]
        n += 1
    return total, n


@pytest.mark.parametrize("cap", [None, 5.0])
def test_ref_matches_naive_and_builtin(cap):
    h, w = torch.randn(9, 6, dtype=torch.float64), torch.randn(11, 6, dtype=torch.float64)
    y = _labels(9, 11, 3)
    total, n = _naive(h, w, y, cap)
    torch.testing.assert_close(linear_cross_entropy_ref(h, w, y, softcap=cap), total / n)
    torch.testing.assert_close(linear_cross_entropy_ref(h, w, y, softcap=cap, reduction="sum", normaliser=4.0),
                               total / 4.0)
    if cap is None:
        torch.testing.assert_close(linear_cross_entropy_ref(h, w, y), F.cross_entropy(h @ w.t(), y))


@pytest.mark.parametrize("cap", [None, 3.0])
def test_ref_gradcheck(cap):
    h = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    y = _labels(5, 7, 1)
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy_ref(a, b, y, softcap=cap), (h, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,hd,v,n_ignore", [(1, 8, 5, 0), (13, 16, 4099, 4), (33, 12, 257, 33)])
@pytest.mark.parametrize("cap,reduction", [(None, "mean"), (30.0, "mean"), (None, "sum")])
def test_triton_matches_reference(dtype, t, hd, v, n_ignore, cap, reduction):
    h = torch.randn(t, hd, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, hd) * 0.5).to(dtype).requires_grad_()
    y = _labels(t, v, n_ignore)
    norm = 7.0 if reduction == "sum" else None
    # a small chunk budget forces several chunks
    loss = linear_cross_entropy(h, w, y, softcap=cap, reduction=reduction, normaliser=norm, chunk_bytes=5 * v * 4)
    ref = linear_cross_entropy(h, w, y, softcap=cap, reduction=reduction, normaliser=norm, impl="reference")
    if n_ignore == t:
        assert loss.item() == 0.0
    else:
        assert_close_lowp(loss, ref, dtype if dtype == torch.float32 else torch.bfloat16)
    (loss * 2.5).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (ref * 2.5).backward()
    if n_ignore == t:
        assert gh.abs().max() == 0 and gw.abs().max() == 0
        return
    low = dtype if dtype == torch.float32 else torch.bfloat16  # fp16 logits hold the scaled grads
    assert_close_lowp(gh, h.grad, low)
    assert_close_lowp(gw, w.grad, low)


def test_no_weight_grad_and_leading_dims():
    h = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(31, 8)
    y = _labels(10, 31, 2).view(2, 5)
    loss = linear_cross_entropy(h, w, y)
    loss.backward()
    ref_h = h.detach().clone().requires_grad_()
    linear_cross_entropy_ref(ref_h, w, y).backward()
    torch.testing.assert_close(loss, linear_cross_entropy_ref(h.detach(), w, y))
    torch.testing.assert_close(h.grad, ref_h.grad)
    out = linear_cross_entropy_fwd(h.detach(), w, y, need_dh=False)
    assert out[1] is None and out[2] is None
    torch.testing.assert_close(out[0], loss.detach())


def test_no_grad_evaluation_returns_the_loss_only():
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(19, 8)
    y = _labels(6, 19, 1)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y, softcap=4.0)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, linear_cross_entropy_ref(h.detach(), w, y, softcap=4.0))
