import pytest
import torch
import torch.nn.functional as F

from whetstone_kernels.swiglu import geglu, glu, glu_bwd, glu_fwd, swiglu
from whetstone_kernels.swiglu_ref import act_grad_ref, glu_ref, glu_ref_bwd

from kernel_test_util import assert_close_lowp

ACTS = ["silu", "gelu", "gelu_tanh"]


def test_ref_matches_torch_builtins():
    g, u = torch.randn(5, 9, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64)
    torch.testing.assert_close(glu_ref(g, u, "silu"), g * torch.sigmoid(g) * u)
    torch.testing.assert_close(glu_ref(g, u, "gelu"), F.gelu(g) * u)
    torch.testing.assert_close(glu_ref(g, u, "gelu_tanh"), F.gelu(g, approximate="tanh") * u)


@pytest.mark.parametrize("act", ACTS)
def test_ref_gradcheck_and_closed_form(act):
    g = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: glu_ref(a, b, act), (g, u))
    gg = torch.randn(50, dtype=torch.float64, requires_grad=True)
    (auto,) = torch.autograd.grad(glu_ref(gg, torch.ones_like(gg), act).sum(), gg)
    torch.testing.assert_close(act_grad_ref(gg.detach(), act), auto)
    dh = torch.randn(4, 7, dtype=torch.float64)
    ag, au = torch.autograd.grad(glu_ref(g, u, act), (g, u), dh)
    dg, du = glu_ref_bwd(dh, g.detach(), u.detach(), act)
    torch.testing.assert_close(ag, dg)
    torch.testing.assert_close(au, du)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (2, 2500)])
@pytest.mark.parametrize("act", ACTS)
def test_triton_matches_reference(dtype, shape, act):
    g = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    u = torch.randn(shape, dtype=dtype, requires_grad=True)
    h = glu(g, u, act)
    hr = glu(g, u, act, impl="reference")
    assert_close_lowp(h, hr, dtype)
    dh = torch.randn_like(h)
    a = torch.autograd.grad(h, (g, u), dh)
    b = torch.autograd.grad(hr, (g, u), dh)
    assert_close_lowp(a[0], b[0], dtype)
    assert_close_lowp(a[1], b[1], dtype)


def test_named_entries_and_inplace_backward():
    g, u = torch.randn(3, 17), torch.randn(3, 17)
    torch.testing.assert_close(swiglu(g, u), F.silu(g) * u)
    torch.testing.assert_close(geglu(g, u), F.gelu(g) * u)
    torch.testing.assert_close(geglu(g, u, approximate="tanh"), F.gelu(g, approximate="tanh") * u)
    torch.testing.assert_close(glu_fwd(g, u), F.silu(g) * u)
    dh = torch.randn(3, 17)
    want = glu_ref_bwd(dh, g, u)
    g2, u2 = g.clone(), u.clone()
    dg, du = glu_bwd(dh, g2, u2, inplace=True)
    assert dg.data_ptr() == g2.data_ptr() and du.data_ptr() == u2.data_ptr()
    torch.testing.assert_close(dg, want[0])
    torch.testing.assert_close(du, want[1])


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (2, 2500)])
@pytest.mark.parametrize("act", ACTS)
def test_bwd_emit_h(act, shape, dtype, inplace):
    """emit_h: h has glu_fwd's bits, lands in dh's storage (inplace too: nothing new is allocated), and
    dgate / dup are those of emit_h=False; the reference's h is glu_ref's, dh left as it was."""
    g = (torch.randn(shape) * 3).to(dtype)
    u = torch.randn(shape, dtype=dtype)
    dh = torch.randn(shape, dtype=dtype)
    want_dg, want_du = glu_bwd(dh, g, u, act)
    dh2, g2, u2 = dh.clone(), g.clone(), u.clone()
    dg, du, h = glu_bwd(dh2, g2, u2, act, inplace=inplace, emit_h=True)
    assert h.data_ptr() == dh2.data_ptr() and h.shape == g.shape and h.dtype == dtype
    if inplace:
        assert dg.data_ptr() == g2.data_ptr() and du.data_ptr() == u2.data_ptr()
    assert torch.equal(h, glu_fwd(g, u, act))
    assert torch.equal(dg, want_dg) and torch.equal(du, want_du)
    rdg, rdu, rh = glu_ref_bwd(dh, g, u, act, emit_h=True)
    assert torch.equal(rh, glu_ref(g, u, act))
    assert_close_lowp(h, rh, dtype)
    assert_close_lowp(dg, rdg, dtype)
    assert_close_lowp(du, rdu, dtype)
    assert rh.data_ptr() != dh.data_ptr()


def test_bwd_emit_h_needs_dh_like_gate():
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(ValueError):
        glu_bwd(torch.randn(4, 8, dtype=torch.float16), g, u, emit_h=True)
    with pytest.raises(ValueError):
        glu_bwd(torch.randn(32), g, u, emit_h=True)
    dg, du = glu_bwd(torch.randn(4, 8, dtype=torch.float16), g, u)  # without emit_h: unchanged behaviour
    assert dg.dtype == torch.float32 and du.shape == (4, 8)
