import math

import pytest
import torch

from whetstone_kernels.rope import rope, rope_bwd, rope_fwd
from whetstone_kernels.rope_ref import packed_position_ids, rope_cos_sin, rope_inv_freq, rope_ref

from kernel_test_util import assert_close_lowp

LLAMA31 = {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072,
           "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
YARN = {"hidden_size": 2048, "num_attention_heads": 16, "max_position_embeddings": 131072, "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
LINEAR = {"hidden_size": 512, "num_attention_heads": 8, "max_position_embeddings": 4096, "rope_theta": 10000.0,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
PHI3 = {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5}


def _naive(x, pos, inv_freq, scaling=1.0):
    """Per-element loops of the rotate-half formula (float64)."""
    out = x.clone().double()
    half = inv_freq.numel()
    for bi in range(x.shape[0]):
        for t in range(x.shape[2]):
            for i in range(half):
                th = pos[bi, t].item() * inv_freq[i].item()
                c, s = math.cos(th) * scaling, math.sin(th) * scaling
                a, b = x[bi, :, t, i].double(), x[bi, :, t, i + half].double()
                out[bi, :, t, i] = a * c - b * s
                out[bi, :, t, i + half] = b * c + a * s
    return out


def test_ref_matches_naive_with_packed_positions_and_partial_rotary():
    q, k = torch.randn(1, 3, 7, 10, dtype=torch.float64), torch.randn(1, 2, 7, 10, dtype=torch.float64)
    inv = 1.0 / (100.0 ** (torch.arange(0, 6, 2).double() / 6))
    pos = packed_position_ids([3, 4], offset=2)
    assert pos.tolist() == [[2, 3, 4, 2, 3, 4, 5]]
    cos, sin = rope_cos_sin(inv, pos, dtype=torch.float64)
    qo, ko = rope_ref(q, k, cos, sin)
    torch.testing.assert_close(qo, _naive(q, pos, inv), atol=1e-5, rtol=1e-5)  # fp32 angles, as HF
    torch.testing.assert_close(ko, _naive(k, pos, inv), atol=1e-5, rtol=1e-5)


def test_ref_gradcheck_and_backward_is_inverse_rotation():
    q = torch.randn(2, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_cos_sin(torch.rand(3, dtype=torch.float64), torch.randint(0, 50, (2, 3)), dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: rope_ref(a, b, cos, sin), (q, k))
    qo, ko = rope_ref(q, k, cos, sin)
    back = rope_ref(qo, ko, cos, -sin)
    torch.testing.assert_close(back[0], q)
    torch.testing.assert_close(back[1], k)


@pytest.mark.parametrize("cfg", [LLAMA31, YARN, PHI3, LINEAR])
def test_inv_freq_matches_transformers(cfg):
    tr = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls = tr.Phi3Config if "partial_rotary_factor" in cfg else tr.LlamaConfig
    hf_cfg = cls(**cfg)
    kind = hf_cfg.rope_parameters.get("rope_type", "default")
    if kind == "default":
        rotary_cls = tr.models.phi3.modeling_phi3.Phi3RotaryEmbedding
        inv_hf, att_hf = rotary_cls.compute_default_rope_parameters(hf_cfg)
    else:
        inv_hf, att_hf = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    inv, att = rope_inv_freq(cfg)
    torch.testing.assert_close(inv, inv_hf.float())
    assert att == pytest.approx(att_hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,hq,hk,s,d,rot", [(1, 1, 1, 1, 4, 4), (2, 3, 1, 5, 12, 12), (1, 5, 2, 7, 20, 10)])
def test_triton_matches_reference(dtype, b, hq, hk, s, d, rot):
    # q as HF produces it: a transposed view of [B, S, H, D]
    q = torch.randn(b, s, hq, d, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, s, hk, d, dtype=dtype).transpose(1, 2).requires_grad_()
    pos = torch.randint(0, 100, (b, s))
    cos, sin = rope_cos_sin(torch.rand(rot // 2), pos, 1.3, dtype=dtype)
    out = rope(q, k, cos, sin)
    ref = rope(q, k, cos, sin, impl="reference")
    assert out[0].stride() == q.stride()
    for o, r in zip(out, ref):
        assert_close_lowp(o, r, dtype)
    gq, gk = torch.randn_like(ref[0]), torch.randn_like(ref[1])
    a = torch.autograd.grad(out, (q, k), (gq, gk))
    r = torch.autograd.grad(ref, (q, k), (gq, gk))
    assert_close_lowp(a[0], r[0], dtype)
    assert_close_lowp(a[1], r[1], dtype)


def test_inplace_launchers_broadcast_tables_and_packed_positions():
    q, k = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8)
    cos, sin = rope_cos_sin(torch.rand(4), packed_position_ids([2, 3, 4]))
    want = rope_ref(q, k, cos, sin)
    q2, k2 = q.clone(), k.clone()
    qo, ko = rope_fwd(q2, k2, cos, sin, inplace=True)
    assert qo.data_ptr() == q2.data_ptr()
    torch.testing.assert_close(qo, want[0])
    torch.testing.assert_close(ko, want[1])
    dq, dk = rope_bwd(qo.clone(), ko.clone(), cos, sin)
    torch.testing.assert_close(dq, q)
    torch.testing.assert_close(dk, k)
    # batch of 2 sharing one table (cos [1, S, R])
    qb, kb = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8)
    out = rope_fwd(qb, kb, cos, sin)
    ref = rope_ref(qb, kb, cos, sin)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])


def test_no_grad_path_gives_the_autograd_values():
    """Without grad ``rope`` calls the forward kernel directly (no autograd node): same bits."""
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = rope_cos_sin(torch.rand(4), torch.arange(5).expand(2, 5))
    with torch.no_grad():
        q0, k0 = rope(q, k, cos, sin)
    q1, k1 = rope(q.requires_grad_(), k, cos, sin)
    assert q0.grad_fn is None and q1.grad_fn is not None
    assert torch.equal(q0, q1) and torch.equal(k0, k1)
