"""whetstone_kernels.launch on the GPU: the direct launch path is taken, gives bit-identical results to
Triton's own launch, follows a change of alignment, and steps aside for launch hooks."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import triton  # noqa: E402

import whetstone_kernels.launch as L  # noqa: E402
from whetstone_kernels.nf4 import _nf4_dequant_kernel, nf4_fwd  # noqa: E402
from whetstone_kernels.nf4_ref import nf4_quantize_ref  # noqa: E402
from whetstone_kernels.rms_norm import _rms_norm_bwd_kernel, _rms_norm_fwd_kernel, rms_norm_bwd, rms_norm_fwd  # noqa: E402
from whetstone_kernels.rope import _rope_kernel, rope_bwd, rope_fwd  # noqa: E402
from whetstone_kernels.rope_ref import rope_cos_sin  # noqa: E402
from whetstone_kernels.swiglu import _glu_bwd_kernel, _glu_fwd_kernel, glu_bwd, glu_fwd  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _ops(dtype):
    """[(name, kernels it launches, fn returning the outputs)] on fixed random inputs."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(37, 4096 + 64, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(4096 + 64, device=DEV, dtype=dtype, generator=g)
    dy = torch.randn_like(x)
    packed, st = nf4_quantize_ref(torch.randn(96, 130, device=DEV, dtype=dtype, generator=g))
    b, s, hq, hk, d = 2, 19, 4, 2, 64
    q = torch.randn(b, hq, s, d, device=DEV, dtype=dtype, generator=g)
    k = torch.randn(b, hk, s, d, device=DEV, dtype=dtype, generator=g)
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d)
    cos, sin = rope_cos_sin(inv, torch.arange(s, device=DEV)[None], dtype=dtype)
    gt, ut = x[:, :1000].contiguous(), dy[:, :1000].contiguous()

    def rms():
        y, rstd = rms_norm_fwd(x, w)
        return (y, rstd) + rms_norm_bwd(dy, x, w, rstd, dres=dy)

    return [
        ("nf4", [_nf4_dequant_kernel], lambda: (nf4_fwd(packed, st, dtype),)),
        ("rms_norm", [_rms_norm_fwd_kernel, _rms_norm_bwd_kernel], rms),
        ("rope", [_rope_kernel], lambda: rope_fwd(q, k, cos, sin) + rope_bwd(q, k, cos, sin)),
        ("glu", [_glu_fwd_kernel, _glu_bwd_kernel], lambda: (glu_fwd(gt, ut, "silu"),) + tuple(
            glu_bwd(ut, gt, ut.clone(), "silu"))),
    ]


def _bits(ts):
    return [t.detach().clone() for t in ts if t is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_path_is_taken_and_bit_identical(monkeypatch, dtype):
    for name, kerns, fn in _ops(dtype):
        monkeypatch.setattr(L, "FAST_LAUNCH", False)
        want = _bits(fn())
        monkeypatch.setattr(L, "FAST_LAUNCH", True)
        L._PLANS.clear()
        first = _bits(fn())    # through Triton; plans made
        plans = [p for (kern, _), p in L._PLANS.items() if kern in kerns]
        assert plans and all(p is not L._NO_PLAN for p in plans), name
        again = _bits(fn())    # the direct path
        torch.cuda.synchronize()
        for a, b, c in zip(want, first, again):
            assert torch.equal(a, b) and torch.equal(a, c), name


def test_alignment_change_is_a_new_key(monkeypatch):
    monkeypatch.setattr(L, "FAST_LAUNCH", True)
    L._PLANS.clear()
    buf = torch.randn(64 * 520 + 8, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(520, device=DEV, dtype=torch.bfloat16)
    aligned = buf[:64 * 520].view(64, 520)
    odd = buf[1:1 + 64 * 520].view(64, 520)   # 2-byte offset: not 16-byte aligned
    assert odd.data_ptr() % 16 != 0
    for _ in range(2):
        rms_norm_fwd(aligned, w)
    y, _ = rms_norm_fwd(odd, w)
    y2, _ = rms_norm_fwd(odd, w)
    ref = (odd.float() * torch.rsqrt(odd.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float())
    assert (y.float() - ref).abs().max().item() < 0.05
    assert torch.equal(y, y2)
    assert len([k for k in L._PLANS if k[0] is _rms_norm_fwd_kernel]) == 2


def test_launch_hooks_see_every_launch(monkeypatch):
    monkeypatch.setattr(L, "FAST_LAUNCH", True)
    x = torch.randn(8, 256, device=DEV)
    w = torch.randn(256, device=DEV)
    for _ in range(2):
        rms_norm_fwd(x, w)   # a plan exists now
    seen = []

    def hook(meta):
        seen.append(1)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(3):
            rms_norm_fwd(x, w)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_dequantizer_is_bit_identical_and_launches_directly(monkeypatch, dtype):
    """nf4_dequantizer's callable gives nf4_fwd's bits call after call, each into a new tensor,
    through the bound launch (no spec_key), on the stream that is current at the call."""
    from whetstone_kernels.nf4 import nf4_dequantizer

    monkeypatch.setattr(L, "FAST_LAUNCH", True)
    g = torch.Generator(device=DEV).manual_seed(1)
    packed, st = nf4_quantize_ref(torch.randn(1024, 384, device=DEV, dtype=dtype, generator=g))
    want = nf4_fwd(packed, st, dtype)
    fn, first = nf4_dequantizer(packed, st, dtype)
    keys = []
    monkeypatch.setattr(L, "spec_key", lambda *a, **k: keys.append(1))
    outs = [fn() for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs.append(fn())
    side.synchronize()
    torch.cuda.synchronize()
    assert not keys   # no key built: the bound path ran
    assert len({o.data_ptr() for o in outs[:3]}) == 3
    for o in [first] + outs:
        assert o.shape == (1024, 384) and o.dtype == dtype and torch.equal(o, want)


def test_bound_dequantizer_steps_aside_for_launch_hooks(monkeypatch):
    from whetstone_kernels.nf4 import nf4_dequantizer

    monkeypatch.setattr(L, "FAST_LAUNCH", True)
    packed, st = nf4_quantize_ref(torch.randn(256, 128, device=DEV))
    fn, first = nf4_dequantizer(packed, st, torch.bfloat16)
    seen = []

    def hook(meta):
        seen.append(1)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        w = fn()
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1 and torch.equal(w, first)


def test_nf4_linear_rebinds_when_its_buffers_are_replaced():
    """NF4Linear.dequant keeps one bound dequantiser per dtype and makes a new one when its
    buffers are replaced (here: new packed data, as _apply / a reload would), never reading the
    old buffers."""
    from worker.engine.quant import NF4Linear

    g = torch.Generator(device=DEV).manual_seed(2)
    w1 = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16, generator=g)
    p1, s1 = nf4_quantize_ref(w1)
    p2, s2 = nf4_quantize_ref(w2)
    lin = NF4Linear(p1, s1.absmax, s1.shape, torch.bfloat16, offset=s1.offset, absmax2=s1.absmax2,
                    code2=s1.code2, impl="triton")
    a, b = lin.dequant(), lin.dequant()
    assert torch.equal(a, nf4_fwd(p1, s1)) and torch.equal(a, b)
    assert list(lin._dequantizers) == [torch.bfloat16]
    lin.packed, lin.absmax, lin.absmax2, lin.offset = p2, s2.absmax, s2.absmax2, s2.offset.reshape(())
    c = lin.dequant()
    assert torch.equal(c, nf4_fwd(p2, s2)) and not torch.equal(c, a)
    assert torch.equal(lin.dequant(torch.float32), nf4_fwd(p2, s2, torch.float32))
    assert lin.dequants == 4
