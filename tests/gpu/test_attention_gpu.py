"""The engine's fused causal attention on CUDA (cuDNN's kernels called directly, with the
hand-held backward) against F.scaled_dot_product_attention: forward and dQ, dK, dV over a grid of
shapes (GQA, odd lengths, head dims 64/128) in bf16 and fp16, each compared with an fp32 reference:
the fused path's error must be within 2x (+ a rounding) of autograd SDPA's own error in the same
dtype. dO is laid out like O in both (see attention._bwd: torch 2.11's cuDNN backward caches its plan
per shape without dO's strides, so one process must not mix dO layouts for a shape). CUDA only;
never in CI."""
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from worker.engine import attention as attn_mod  # noqa: E402

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("B,Hq,Hk,S,D", [(1, 8, 8, 2, 64), (2, 32, 8, 77, 128), (1, 16, 4, 1000, 64),
                                         (2, 12, 2, 513, 128), (1, 32, 8, 4096, 128)])
def test_fused_attention_matches_sdpa(B, Hq, Hk, S, D, dtype, layout):
    """layout "bshd": q, k, v and dO are [B, S, H, D] memory seen as [B, H, S, D], as the engine's
    layers hand them over (dO from o.transpose(1, 2).reshape's backward); "bhsd": dense."""
    g = torch.Generator(device="cuda").manual_seed(S + Hq)

    def make(h):
        if layout == "bshd":
            return torch.randn(B, S, h, D, device="cuda", generator=g).transpose(1, 2)
        return torch.randn(B, h, S, D, device="cuda", generator=g)
    q, k, v = make(Hq), make(Hk), make(Hk)
    do = make(Hq)  # laid out like O (cuDNN's O follows Q), as autograd hands it over
    scale = D ** -0.5

    def run(fn, dt):
        ins = [t.to(dt).detach().requires_grad_(True) for t in (q, k, v)]
        out = fn(*ins)
        return (out, *torch.autograd.grad(out, ins, do.to(dt)))

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale,
                                              enable_gqa=Hq != Hk)

    ref = run(sdpa, torch.float32)
    base = run(sdpa, dtype)
    got = run(lambda a, b, c: attn_mod.SDPAFunction.apply(a, b, c, scale, False), dtype)
    for name, r, b_, x in zip(("out", "dq", "dk", "dv"), ref, base, got):
        assert x.shape == r.shape and x.dtype == dtype and torch.isfinite(x).all(), name
        e_base, e_got = _rel(b_, r), _rel(x, r)
        assert e_got <= 2 * e_base + 4e-3, (name, e_got, e_base)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,Hq,Hk,D,rows", [
    (1, 8, 8, 64, [5, 1, 58]), (1, 32, 8, 128, [300, 17, 700, 7]), (2, 16, 4, 64, [100, 28]),
    (1, 32, 8, 128, [2048, 1024, 512, 512]), (2, 12, 2, 128, [1, 1, 254])])
def test_varlen_attention_matches_masked_sdpa(B, Hq, Hk, D, rows, dtype):
    """Packed rows (position_ids restart; each batch row holds ``rows``) through FlashAttention's
    varlen kernel (worker/engine/varlen.py) against the dense route: F.sdpa with the boolean mask
    of attention.build_mask. Forward and dQ, dK, dV, each compared with the fp32 dense result:
    within 2x (+ a rounding) of the dense route's own error in the same dtype."""
    from worker.engine import varlen

    S = sum(rows)
    pos = torch.cat([torch.arange(n) for n in rows]).expand(B, S).cuda()
    seg = varlen.segments(pos)
    assert seg.cu_seqlens.numel() == B * len(rows) + 1 and seg.max_len == max(rows)
    mask = attn_mod.build_mask(pos, None, S, None, "cuda")
    g = torch.Generator(device="cuda").manual_seed(S + Hq)
    q, k, v = (torch.randn(B, S, h, D, device="cuda", generator=g).transpose(1, 2)
               for h in (Hq, Hk, Hk))
    do = torch.randn(B, S, Hq * D, device="cuda", generator=g)
    scale = D ** -0.5

    def run(fn, dt):
        ins = [t.to(dt).detach().requires_grad_(True) for t in (q, k, v)]
        out = fn(*ins)
        return (out, *torch.autograd.grad(out, ins, do.to(dt)))

    def dense(a, b, c):
        return attn_mod.attention(a, b, c, mask, scale, None)

    ref = run(dense, torch.float32)
    base = run(dense, dtype)
    calls = []
    apply = varlen.VarlenFunction.apply
    try:
        varlen.VarlenFunction.apply = lambda *a: calls.append(1) or apply(*a)
        got = run(lambda a, b, c: attn_mod.attention(a, b, c, seg, scale, None), dtype)
    finally:
        varlen.VarlenFunction.apply = apply
    assert calls and varlen._WORKS[0], "the varlen kernel did not run"
    for name, r, b_, x in zip(("out", "dq", "dk", "dv"), ref, base, got):
        assert x.shape == r.shape and x.dtype == dtype and torch.isfinite(x).all(), name
        e_base, e_got = _rel(b_, r), _rel(x, r)
        assert e_got <= 2 * e_base + 4e-3, (name, e_got, e_base)
