import pytest
import torch

from whetstone_kernels.rms_norm import rms_norm, rms_norm_bwd, rms_norm_fwd, rms_norm_residual
from whetstone_kernels.rms_norm_ref import rms_norm_ref, rms_norm_ref_bwd

from kernel_test_util import assert_close_lowp


@pytest.mark.parametrize("gemma", [False, True])
def test_ref_matches_torch_builtin(gemma):
    x = torch.randn(4, 7, 33, dtype=torch.float64)
    w = torch.randn(33, dtype=torch.float64)
    want = torch.nn.functional.rms_norm(x, (33,), (1 + w) if gemma else w, eps=1e-5)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-5, gemma), want)


@pytest.mark.parametrize("gemma", [False, True])
def test_ref_gradcheck_and_closed_form(gemma):
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm_ref(a, b, 1e-6, gemma), (x, w))
    dy = torch.randn(3, 11, dtype=torch.float64)
    gx, gw = torch.autograd.grad(rms_norm_ref(x, w, 1e-6, gemma), (x, w), dy)
    dx, dw = rms_norm_ref_bwd(dy, x.detach(), w.detach(), 1e-6, gemma)
    torch.testing.assert_close(gx, dx.double())
    torch.testing.assert_close(gw, dw.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3), (3, 5, 37), (19, 130)])
@pytest.mark.parametrize("gemma", [False, True])
def test_triton_matches_reference(dtype, shape, gemma):
    n = shape[-1]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (torch.rand(n, dtype=dtype) * 2).requires_grad_()
    y = rms_norm(x, w, 1e-6, gemma)
    yr = rms_norm(x, w, 1e-6, gemma, impl="reference")
    assert_close_lowp(y, yr, dtype)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    rx, rw = torch.autograd.grad(yr, (x, w), dy)
    assert_close_lowp(gx, rx, dtype)
    assert_close_lowp(gw, rw, dtype)


def test_launchers_and_noncontiguous_input():
    x = torch.randn(6, 40)[:, :24]  # row stride 40, last dim contiguous
    w = torch.randn(24)
    y, rstd = rms_norm_fwd(x, w)
    torch.testing.assert_close(y, rms_norm_ref(x, w))
    torch.testing.assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1) + 1e-6))
    dy = torch.randn(6, 24)
    dx, dw = rms_norm_bwd(dy, x, w, rstd)
    rdx, rdw = rms_norm_ref_bwd(dy, x, w)
    torch.testing.assert_close(dx, rdx)
    torch.testing.assert_close(dw, rdw)
    dx2, dw2 = rms_norm_bwd(dy, x, w, rstd, need_dw=False)  # frozen weight: one program per row
    assert dw2 is None
    torch.testing.assert_close(dx2, rdx)
    # autograd with a frozen weight takes the same path
    xg = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(rms_norm(xg, w, gemma=True), xg, dy)
    torch.testing.assert_close(gx, rms_norm_ref_bwd(dy, x, w, gemma=True)[0])
    with pytest.raises(ValueError):
        rms_norm(x, w, impl="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3), (3, 5, 37), (19, 130)])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_residual_form_matches_reference(dtype, shape, gemma, frozen):
    """x + f(rms_norm(x)) through rms_norm_residual: the same value and the same dx (both branches
    summed in the kernel), dw, as the reference with autograd summing the branches."""
    n = shape[-1]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (torch.rand(n, dtype=dtype) * 2).requires_grad_(not frozen)
    dy, dres = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    outs = []
    for impl in ("triton", "reference"):
        y, res = rms_norm_residual(x, w, 1e-6, gemma, impl=impl)
        assert torch.equal(res, x)
        wrt = (x,) if frozen else (x, w)
        outs.append((y, torch.autograd.grad((y * dy).sum() + (res * dres).sum(), wrt)))
    (y, g), (yr, gr) = outs
    assert_close_lowp(y, yr, dtype)
    for a, b in zip(g, gr):
        assert_close_lowp(a, b, dtype)
    # only the residual branch used: dx is dres exactly
    y, res = rms_norm_residual(x, w, 1e-6, gemma)
    (gx,) = torch.autograd.grad((res * dres).sum(), x)
    torch.testing.assert_close(gx, dres)


def test_no_grad_path_gives_the_autograd_values():
    """Without grad the wrappers call the forward kernel directly (no autograd node): same bits."""
    x, w = torch.randn(5, 37), torch.rand(37) + 0.5
    with torch.no_grad():
        y0 = rms_norm(x, w, 1e-6, True)
        y1, r1 = rms_norm_residual(x, w, 1e-6, True)
    y2 = rms_norm(x.requires_grad_(), w, 1e-6, True)
    y3, _ = rms_norm_residual(x, w, 1e-6, True)
    assert y0.grad_fn is None and y1.grad_fn is None and r1 is x
    assert torch.equal(y0, y2) and torch.equal(y1, y3)
