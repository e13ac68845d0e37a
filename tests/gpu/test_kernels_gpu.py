"""GPU grid for kernels/ (runs only where CUDA exists; skipped in CI).

For every op, shape (odd, non-power-of-two, tiny, large) and dtype (fp32, bf16, fp16), on fresh random
inputs, with the allocator's free memory poisoned with NaN before each launch (and NaN-filled ``out=``
buffers where a launcher takes one), the output and every gradient must satisfy

    max|k - ref32| <= 2 * max|ref_lowp - ref32| + atol * max|ref32|

ref32 = the reference on inputs upcast to fp64, ref_lowp = the
same reference run in the test dtype. NF4 must be bit-exact with bitsandbytes' CUDA dequantize_4bit.
"""
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from whetstone_kernels.cross_entropy import linear_cross_entropy  # noqa: E402
from whetstone_kernels.cross_entropy_ref import linear_cross_entropy_ref  # noqa: E402
from whetstone_kernels.nf4 import nf4_fwd, nf4_linear  # noqa: E402
from whetstone_kernels.nf4_matmul import nf4_matmul  # noqa: E402
from whetstone_kernels.nf4_ref import nf4_dequantize_ref, nf4_quantize_ref, nf4_state_from_bnb  # noqa: E402
from whetstone_kernels.skinny_matmul import skinny_matmul  # noqa: E402
from whetstone_kernels.rms_norm import rms_norm, rms_norm_residual  # noqa: E402
from whetstone_kernels.rms_norm_ref import rms_norm_ref  # noqa: E402
from whetstone_kernels.rope import rope  # noqa: E402
from whetstone_kernels.rope_ref import packed_position_ids, rope_cos_sin, rope_inv_freq, rope_ref  # noqa: E402
from whetstone_kernels.swiglu import glu, glu_bwd, glu_fwd  # noqa: E402
from whetstone_kernels.swiglu_ref import glu_ref  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # zlib.crc32, not hash(): str hashes are salted per process, so a failure would not reproduce
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


def poison(nbytes=1 << 28):
    """Fill free allocator blocks with NaN so an unwritten output element shows up."""
    torch.empty(nbytes // 4, dtype=torch.float32, device=DEV).fill_(float("nan"))


def check(k, low, hi, dtype, what, extra_roundings=0):
    """``extra_roundings``: roundings to ``dtype`` the kernel does by design beyond the reference's;
    each may add half an ulp of the largest value (2**-mantissa_bits relative)."""
    assert k.shape == hi.shape, (what, k.shape, hi.shape)
    k, low, hi = k.double(), low.double(), hi.double()
    assert torch.isfinite(k).all(), f"{what}: non-finite values"
    err = (k - hi).abs().max().item()
    ulp = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    budget = (2 * (low - hi).abs().max().item() + (ATOL[dtype] + extra_roundings * ulp / 2)
              * hi.abs().max().item())
    assert err <= budget, f"{what}: max err {err:.3e} > budget {budget:.3e}"


def run_grads(fn, inputs, grads_out):
    """Forward + backward with poisoned memory; returns (outputs, input grads)."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    poison()
    out = fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    poison()
    gs = torch.autograd.grad(outs, [x for x in xs if x.requires_grad], grads_out)
    return [o.detach() for o in outs], list(gs)


def compare(kfn, rfn, inputs, dtype, make_grads, what, grad_roundings=0):
    lowp = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    hi = [x.double() if x.is_floating_point() else x for x in inputs]
    with torch.no_grad():
        o = rfn(*hi)
    grads = make_grads(o)
    r_out, r_g = run_grads(rfn, hi, [g.double() for g in grads])
    l_out, l_g = run_grads(rfn, lowp, [g.to(dtype) for g in grads])
    k_out, k_g = run_grads(kfn, lowp, [g.to(dtype) for g in grads])
    for i, (a, b, c) in enumerate(zip(k_out, l_out, r_out)):
        check(a, b, c, dtype, f"{what} out{i}")
    for i, (a, b, c) in enumerate(zip(k_g, l_g, r_g)):
        check(a, b, c, dtype, f"{what} grad{i}", grad_roundings)


def _randn_like(o):
    return [torch.randn_like(x) for x in (o if isinstance(o, tuple) else (o,))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 37), (7, 1000), (257, 5120), (4096, 4096), (33, 16384)])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("frozen_w", [False, True])
def test_rms_norm(dtype, shape, gemma, frozen_w):
    x = torch.randn(shape, device=DEV) * 3
    w = torch.rand(shape[-1], device=DEV) + 0.5
    if frozen_w:  # LoRA: w needs no grad -> the one-program-per-row backward
        compare(lambda a: rms_norm(a, w.to(a.dtype), 1e-6, gemma), lambda a: rms_norm_ref(a, w.to(a.dtype), 1e-6, gemma),
                [x], dtype, _randn_like, f"rms{shape} frozen")
        return
    compare(lambda a, b: rms_norm(a, b, 1e-6, gemma), lambda a, b: rms_norm_ref(a, b, 1e-6, gemma),
            [x, w], dtype, _randn_like, f"rms{shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 37), (257, 5120), (4096, 4096)])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_residual(dtype, shape, gemma):
    """(norm(x), x) with both gradients summed in the backward kernel vs the reference + autograd."""
    x = torch.randn(shape, device=DEV) * 3
    w = torch.rand(shape[-1], device=DEV) + 0.5
    compare(lambda a: rms_norm_residual(a, w.to(a.dtype), 1e-6, gemma),
            lambda a: (rms_norm_ref(a, w.to(a.dtype), 1e-6, gemma), a.view_as(a)),
            [x], dtype, _randn_like, f"rms_res{shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 7, 13), (4097, 11008), (2048, 14336)])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_glu(dtype, shape, act):
    g, u = torch.randn(shape, device=DEV) * 3, torch.randn(shape, device=DEV)
    compare(lambda a, b: glu(a, b, act), lambda a, b: glu_ref(a, b, act), [g, u], dtype, _randn_like,
            f"{act}{shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 13), (4097, 11008)])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_glu_bwd_emits_h(dtype, shape, act):
    """glu_bwd(emit_h=True): the same dG, dU as without, and H over dh, bitwise glu_fwd's H."""
    g, u = (torch.randn(shape, device=DEV) * 3).to(dtype), torch.randn(shape, device=DEV).to(dtype)
    dh = torch.randn(shape, device=DEV).to(dtype)
    dg, du = glu_bwd(dh, g, u, act)
    dh2 = dh.clone()
    dg2, du2, h = glu_bwd(dh2, g.clone(), u.clone(), act, inplace=True, emit_h=True)
    assert h.data_ptr() == dh2.data_ptr()
    assert torch.equal(dg2, dg) and torch.equal(du2, du)
    assert torch.equal(h, glu_fwd(g, u, act))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,hq,hk,s,d,rot", [(1, 1, 1, 1, 4, 4), (2, 32, 8, 17, 128, 128), (3, 5, 2, 33, 96, 48),
                                             (1, 28, 4, 257, 128, 64), (2, 32, 8, 2048, 128, 128)])
def test_rope(dtype, b, hq, hk, s, d, rot):
    q = torch.randn(b, s, hq, d, device=DEV).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=DEV).transpose(1, 2)
    cfg = {"hidden_size": hq * d, "num_attention_heads": hq, "head_dim": d, "rope_theta": 500000.0,
           "partial_rotary_factor": rot / d, "max_position_embeddings": 131072,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    inv, att = rope_inv_freq(cfg, DEV)
    pos = packed_position_ids([s // 2, s - s // 2], offset=5, device=DEV).expand(b, s) if s > 1 \
        else torch.randint(0, 9000, (b, s), device=DEV)
    cos, sin = rope_cos_sin(inv, pos, att)  # fp32 tables, shared by all precisions

    def kfn(a, c):
        return rope(a, c, cos, sin)

    def rfn(a, c):
        return rope_ref(a, c, cos.to(a.dtype) if a.dtype == torch.float64 else cos,
                        sin.to(a.dtype) if a.dtype == torch.float64 else sin)

    compare(kfn, rfn, [q, k], dtype, _randn_like, f"rope{(b, hq, hk, s, d, rot)}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,v,ignore,cap,reduction", [
    (1, 16, 17, 0, None, "mean"), (257, 64, 1000, 10, 30.0, "mean"), (300, 96, 32003, 50, None, "sum"),
    (2048, 4096, 128256, 100, None, "mean")])
def test_linear_cross_entropy(dtype, t, h, v, ignore, cap, reduction):
    hid = torch.randn(t, h, device=DEV)
    w = torch.randn(v, h, device=DEV) / h ** 0.5
    y = torch.randint(0, v, (t,), device=DEV)
    y[torch.randperm(t, device=DEV)[:ignore]] = -100
    norm = 123.0 if reduction == "sum" else None
    kw = dict(softcap=cap, reduction=reduction, normaliser=norm)

    def kfn(a, b):
        return linear_cross_entropy(a, b, y, chunk_bytes=64 << 20, **kw)

    def rfn(a, b):
        return linear_cross_entropy_ref(a, b, y, upcast=a.dtype == torch.float64, **kw)

    # dh / dW are computed (and rounded to dtype) in forward, then scaled by the incoming grad (1.7) in
    # backward: one more rounding than the reference, where the 1.7 flows through before rounding
    compare(kfn, rfn, [hid, w], dtype, lambda o: [torch.tensor(1.7, device=DEV)], f"ce{(t, h, v)}",
            grad_roundings=1)


NF4_SHAPES = [(64, 64), (5, 77), (96, 160), (4096, 4096), (14336, 4096), (4096, 14336)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NF4_SHAPES)
@pytest.mark.parametrize("double", [True, False])
def test_nf4_bit_exact_with_reference(dtype, shape, double):
    packed, state = nf4_quantize_ref((torch.randn(shape, device=DEV) * 0.02).to(dtype), double_quant=double)
    want = nf4_dequantize_ref(packed, state)
    got = nf4_fwd(packed, state, out=torch.full(shape, float("nan"), dtype=dtype, device=DEV))
    assert torch.equal(got, want), f"{(got.float() - want.float()).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NF4_SHAPES)
def test_nf4_bit_exact_with_bitsandbytes(dtype, shape):
    w = (torch.randn(shape, device=DEV) * 0.02).to(dtype)
    try:
        import bitsandbytes.functional as F

        packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        want = F.dequantize_4bit(packed, qs)
    except Exception as e:  # absent, or no CUDA library for this machine
        pytest.skip(f"bitsandbytes unusable here: {e!r}")
    state = nf4_state_from_bnb(qs)
    got = nf4_fwd(packed, state, out=torch.full(shape, float("nan"), dtype=dtype, device=DEV))
    assert torch.equal(got, want), f"{(got.float() - want.float()).abs().max()}"
    assert torch.equal(nf4_dequantize_ref(packed, state), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nf4_linear_grad(dtype):
    packed, st = nf4_quantize_ref(torch.randn(1000, 4096, device=DEV) * 0.02)
    x = torch.randn(3, 77, 4096, device=DEV, dtype=dtype, requires_grad=True)
    y = nf4_linear(x, packed, st)
    yr = nf4_linear(x, packed, st, impl="reference")
    torch.testing.assert_close(y, yr)
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(yr, x, dy)[0])


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("m", [1, 8, 16, 64])
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)])
def test_nf4_matmul_decode(shape, m, nested):
    """Fused decode matmul (bf16, Llama-3.1-8B weight shapes) vs nf4_fwd + matmul, against fp64."""
    packed, st = nf4_quantize_ref(torch.randn(shape, device=DEV) * 0.02, double_quant=nested)
    x = torch.randn(m, shape[1], device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(shape[0], device=DEV, dtype=torch.bfloat16) if m == 8 else None
    with torch.no_grad():
        poison()
        got = nf4_matmul(x, packed, st, bias)
        again = nf4_matmul(x, packed, st, bias)
        low = x @ nf4_fwd(packed, st, torch.bfloat16).t() + (bias if bias is not None else 0)
        hi = x.double() @ nf4_dequantize_ref(packed, st, torch.float64).t() + (
            bias.double() if bias is not None else 0)
    check(got, low, hi, torch.bfloat16, f"nf4_matmul {m}x{shape}")
    assert torch.equal(got, again)  # split-K partials summed in fixed order


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (14336, 4096)])
def test_nf4_matmul_lora_epilogue(shape, m):
    """The LoRA term (x A^T) B^T * s added in the kernel's epilogue (bf16, r=16, split-K on the
    small shapes), vs dequantise + GEMM + the term, against fp64."""
    packed, st = nf4_quantize_ref(torch.randn(shape, device=DEV) * 0.02, double_quant=True)
    x = torch.randn(m, shape[1], device=DEV, dtype=torch.bfloat16)
    A = torch.randn(16, shape[1], device=DEV, dtype=torch.bfloat16) * 0.02
    B = torch.randn(shape[0], 16, device=DEV, dtype=torch.bfloat16) * 0.5
    with torch.no_grad():
        poison()
        xa = x @ A.t()
        got = nf4_matmul(x, packed, st, lora=(xa, B, 2.0))
        low = x @ nf4_fwd(packed, st, torch.bfloat16).t() + 2.0 * (xa @ B.t())
        hi = x.double() @ nf4_dequantize_ref(packed, st, torch.float64).t() + 2.0 * (xa.double() @ B.double().t())
    check(got, low, hi, torch.bfloat16, f"nf4_matmul + lora {m}x{shape}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,r,k", [(1, 48, 4096), (16, 48, 4096), (16, 32, 4096), (16, 16, 14336),
                                   (33, 16, 4096), (64, 128, 4096)])
def test_skinny_matmul(dtype, m, r, k):
    """x A^T of the decoder's LoRA A matrices (q/k/v stacked: 48, gate/up: 32, down: K 14,336) at
    Llama-3.1-8B shapes, split-K with the last program reducing, against fp64; the same bits twice."""
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    A = (torch.randn(r, k, device=DEV) * 0.02).to(dtype)
    with torch.no_grad():
        poison()
        got = skinny_matmul(x, A)
        again = skinny_matmul(x, A)
        low = x @ A.t()
        hi = x.double() @ A.double().t()
    check(got, low, hi, dtype, f"skinny_matmul {m}x{k}->{r}")
    assert torch.equal(got, again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nf4_matmul_dtypes(dtype):
    packed, st = nf4_quantize_ref(torch.randn(1000, 4096, device=DEV) * 0.02)
    x = torch.randn(3, 5, 4096, device=DEV, dtype=dtype)
    with torch.no_grad():
        got = nf4_matmul(x, packed, st)
        low = nf4_matmul(x, packed, st, impl="reference")
        hi = x.double() @ nf4_dequantize_ref(packed, st, torch.float64).t()
    check(got, low, hi, dtype, f"nf4_matmul {dtype}")
