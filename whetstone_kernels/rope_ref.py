"""Rotary position embedding reference (plain PyTorch; oracle for whetstone_kernels/rope.py), plus the frequency
helpers that turn a Hugging Face config dict into inverse frequencies and cos/sin tables.

HF "rotate-half" layout: for a head vector x of size D and rotary size R <= D (partial rotary, e.g.
Phi-3: R = D * partial_rotary_factor), x1 = x[:R/2], x2 = x[R/2:R], and with angles theta_i = pos * inv_freq_i:

    forward:  y1 = x1 cos - x2 sin;   y2 = x2 cos + x1 sin;   y[R:] = x[R:]
    backward: the rotation by -theta:  dx1 = dy1 cos + dy2 sin;  dx2 = dy2 cos - dy1 sin;  dx[R:] = dy[R:]

cos/sin are given as HF builds them: [B or 1, S, R], the two halves equal (cat(freqs, freqs)), already
multiplied by the attention scaling (YaRN). Positions come from position_ids [B, S]: offsets (KV cache)
and packed sequences whose positions restart (see ``packed_position_ids``) are just other position_ids.

Frequencies (``rope_inv_freq``), written from the published methods and checked against HF's
ROPE_INIT_FUNCTIONS in the tests: default, linear, llama3 (Llama-3.1 smooth low/high-frequency
interpolation), yarn (Peng et al. 2023, ramp between beta_fast/beta_slow, mscale attention factor).
"""
from __future__ import annotations

import math

import torch


def _rope_params(config: dict) -> dict:
    rp = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rp.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "partial_rotary_factor" not in rp and "partial_rotary_factor" in config:
        rp["partial_rotary_factor"] = config["partial_rotary_factor"]
    rp["rope_type"] = rp.get("rope_type", rp.get("type", "default"))
    return rp


def rope_inv_freq(config: dict, device=None):
    """(inv_freq [R/2] fp32, attention_scaling float) from a HF config dict (config.to_dict())."""
    rp = _rope_params(config)
    base = float(rp["rope_theta"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base ** exps)
    kind = rp["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rp["factor"], 1.0
    if kind == "llama3":
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old_ctx = rp["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        max_pos = config.get("max_position_embeddings")
        orig = rp.get("original_max_position_embeddings") or max_pos
        factor = rp.get("factor") or max_pos / orig
        attn = rp.get("attention_factor")
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attn is None:
            attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
                else get_mscale(factor)
        beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

        def corr_dim(rot):  # dimension index whose wavelength makes `rot` turns over the original context
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if rp.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.device)
        extrap = 1 - ramp  # 1: keep the original frequency (high frequencies); 0: interpolate
        return (inv_freq / factor) * (1 - extrap) + inv_freq * extrap, float(attn)
    raise NotImplementedError(f"rope_type {kind!r} is not supported")


def packed_position_ids(seq_lens, offset: int = 0, device=None) -> torch.Tensor:
    """[1, sum(seq_lens)] positions restarting at `offset` for each packed sequence."""
    return torch.cat([torch.arange(offset, offset + int(n), device=device) for n in seq_lens]).unsqueeze(0)


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, attention_scaling: float = 1.0,
                 dtype=torch.float32):
    """HF-style tables: cos, sin of shape [B, S, R] (halves duplicated), fp32 maths, cast to dtype."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B or 1, S, R]; returns rotated (q, k) in their dtypes.
    fp32 maths for fp16/bf16 inputs; differentiable by autograd."""
    rot = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def one(x):
        up = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        cc, ss = c.to(up.dtype), s.to(up.dtype)
        xr, xp = up[..., :rot], up[..., rot:]
        return torch.cat([xr * cc + rotate_half(xr) * ss, xp], dim=-1).to(x.dtype)

    return one(q), one(k)
