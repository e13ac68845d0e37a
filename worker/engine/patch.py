"""Per-architecture description and the fused decoder layer that runs on *our* model instance.

Nothing here patches a library class. :func:`arch_spec` reads a HF config (and our instance) and
describes the layer: Llama 2/3.x, Mistral, Qwen2/2.5 (q/k/v bias) share one layout; Qwen3 adds a
q/k RMSNorm over the head dim; Gemma 2/3 use (1 + w) norms, four norms a layer (sandwich), GeGLU
(tanh), Gemma 2 attention-logit and final-logit soft-capping, Gemma 3 q/k norms and per-layer-type
RoPE (local/global). Anything else (Phi-3's fused qkv/gate_up, MoE, multimodal) raises
:class:`Unsupported`, and the engine leaves the model on PEFT's plain modules.

:func:`run_layer` is one decoder layer, h [B, S, H] -> [B, S, H], reading the weights of the HF layer
module and its PEFT LoRA wrappers, as two blocks (each one checkpointed segment):

    attn_block: x = norm(h); q, k, v = LoRAProj(x) (one pass); [q/k norm]; RoPE (whetstone_kernels.rope);
        o = attention(q, k, v) (:mod:`~worker.engine.attention`: fused causal SDPA with a hand-held
        backward, or a boolean block mask for padding, packed sequences and sliding windows, or an
        explicit soft-capped softmax for Gemma 2); h = h + [norm](LoRAProj_o(o))
    mlp_block:  h = h + [norm](LoRAMLP(norm(h)))   (gate, up, GLU, down in one autograd function)

Without a sandwich norm the residual h is added inside the o_proj / down_proj GEMMs (no separate
add kernel). The LoRA weights are cast to the compute dtype once per forward (``StepInputs.casts``).
In a checkpointed segment's recompute (:func:`~worker.engine.checkpointing.recomputing`) the block's
output value is discarded, so without a sandwich norm the last projection (o_proj, down_proj) skips
its base GEMM and the residual and returns an uninitialised tensor (only its graph is
back-propagated: the residual's gradient is dY itself, no values are read); attention returns the
output its forward stashed, and when it also stashed Q, K, V the q/k/v projections skip their base
GEMMs. Gemma's post-attention and
post-feedforward norms read their input in backward, so sandwich layers compute it.

Norms are whetstone_kernels.rms_norm, dtypes follow h. A projection group whose LoRA cannot be fused (dropout,
DoRA) runs through its PEFT modules instead; the rest of the layer stays fused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine import checkpointing as ckpt
from worker.engine import varlen
from worker.engine.attention import attention, build_mask, mask_kind, stash_choice
from worker.engine.checkpointing import recomputing
from worker.engine.lora_ops import (CastCache, LoRAMLPFunction, LoRAProjFunction, make_proj,
                                    mlp_forward, proj_forward)

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
GEMMA_LIKE = ("gemma2", "gemma3_text")
ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
        "gelu_fast": "gelu_tanh", "gelu": "gelu"}


class Unsupported(Exception):
    """This architecture is not patched; the model trains with PEFT's plain modules."""


@dataclass
class ArchSpec:
    model_type: str
    activation: str
    gemma_norm: bool
    sandwich: bool
    qk_norm: bool
    attn_softcap: float | None
    final_softcap: float | None
    layer_types: list[str]
    windows: dict[str, int | None] = field(default_factory=dict)
    rope_per_type: bool = False


def arch_spec(model) -> ArchSpec:
    """Describe ``model`` (a HF *ForCausalLM instance) or raise Unsupported with the reason."""
    cfg = model.config
    mt = getattr(cfg, "model_type", "?")
    if mt not in LLAMA_LIKE + GEMMA_LIKE:
        raise Unsupported(f"architecture {mt!r} has no fused path")
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        raise Unsupported(f"{type(model).__name__} does not have the model.layers / lm_head layout")
    act_name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act_name not in ACTS:
        raise Unsupported(f"activation {act_name!r}")
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    sw = getattr(cfg, "sliding_window", None)
    if mt == "mistral" and sw:
        types = ["sliding_attention"] * n
    if mt == "qwen2" and not getattr(cfg, "use_sliding_window", False):
        types = ["full_attention"] * n
    windows = {"full_attention": None, "sliding_attention": sw}
    if any(t not in windows for t in types):
        raise Unsupported(f"layer types {sorted(set(types))}")
    gemma = mt in GEMMA_LIKE
    return ArchSpec(
        model_type=mt, activation=ACTS[act_name], gemma_norm=gemma, sandwich=gemma,
        qk_norm=mt in ("qwen3", "gemma3_text"),
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
        layer_types=types, windows=windows, rope_per_type=mt == "gemma3_text")


def _eps(mod) -> float:
    return getattr(mod, "variance_epsilon", None) or getattr(mod, "eps", 1e-6)


def norm(mod, x, gemma: bool, impl: str):
    from whetstone_kernels.rms_norm import rms_norm

    return rms_norm(x, mod.weight, _eps(mod), gemma=gemma, impl=impl)


def norm_residual(mod, x, gemma: bool, impl: str):
    """(norm(x), x) where x's two gradients are summed in the norm's backward kernel
    (whetstone_kernels.rms_norm.rms_norm_residual): for a pre-norm block x + f(norm(x))."""
    from whetstone_kernels.rms_norm import rms_norm_residual

    return rms_norm_residual(x, mod.weight, _eps(mod), gemma=gemma, impl=impl)


def _collect(modules, memo=None):
    """(projs, [A, B, ...]) for the fused functions, or None when a module's LoRA is not fusable.
    ``memo`` (the forward's StepInputs.collected) keeps the answer for the recompute."""
    key = tuple(id(m) for m in modules)
    if memo is not None and key in memo:
        return memo[key]
    projs, ab = [], []
    try:
        for m in modules:
            p, t = make_proj(m)
            projs.append(p)
            ab += t
        got = tuple(projs), ab
    except ValueError:
        got = None
    if memo is not None:
        memo[key] = got
    return got


def _group(x, modules, step=None, need_y=True, residual=None):
    """Outputs of several projections of x: fused LoRAProj, or the PEFT modules as a fallback.
    ``need_y`` False: the fused outputs are uninitialised (only their graph is used).
    ``residual`` (one module only): returns (residual + proj(x),), added inside the GEMMs.
    Without grad the fused forward runs without an autograd node."""
    got = _collect(modules, step.collected if step is not None else None)
    if got is None:
        out = tuple(m(x) for m in modules)
        return out if residual is None else (residual + out[0],)
    casts = step.casts if step is not None else None
    if not torch.is_grad_enabled():
        return proj_forward(x, got[0], need_y, casts, residual, got[1])[0]
    return LoRAProjFunction.apply(x, got[0], need_y, casts, residual, *got[1])


def _mlp(x, mlp, activation, impl, step=None, need_y=True, residual=None):
    """[residual +] the gated MLP of x: fused LoRAMLP, or the PEFT modules as a fallback."""
    mods = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    got = _collect(mods, step.collected if step is not None else None)
    if got is None:
        from worker.engine.lora_ops import _glu

        m = mods[2](_glu(impl)[0](mods[0](x), mods[1](x), activation))
        return m if residual is None else residual + m
    casts = step.casts if step is not None else None
    if not torch.is_grad_enabled():
        return mlp_forward(x, got[0], activation, impl, need_y, casts, residual, got[1])[0]
    return LoRAMLPFunction.apply(x, got[0], activation, impl, need_y, casts, residual, *got[1])


@dataclass
class StepInputs:
    """Per-forward tables shared by all layers: rope[type] = (cos, sin), mask[type] (bool, None, or
    :class:`~worker.engine.varlen.Segments` for packed rows),
    and, made once per forward, the LoRA weights in the compute dtype (``casts``) and each
    projection group's fused-path description (``collected``), both reused by the recompute."""

    rope: dict
    mask: dict
    casts: CastCache = field(default_factory=CastCache)
    collected: dict = field(default_factory=dict)


def _in_out(module) -> int:
    base = getattr(module, "base_layer", module)
    return base.in_features * base.out_features


def attn_block(layer, h, step: StepInputs, arch: ArchSpec, impl: str):
    """h + [norm](o_proj(attention(rope(q, k), v))) with q, k, v from norm(h); h [B, S, H].

    In a checkpointed recompute (:func:`~worker.engine.checkpointing.recomputing`) the block's
    output is discarded: o_proj skips its base GEMM (not with a sandwich norm, whose backward reads
    o), and when the attention stashed Q, K, V in the forward (no q/k norm, whose backward reads
    the projections) the q/k/v projections skip theirs too: attention returns the stashed output.
    """
    from whetstone_kernels.rope import rope

    attn = layer.self_attn
    ltype = arch.layer_types[attn.layer_idx] if hasattr(attn, "layer_idx") else "full_attention"
    B, S, _ = h.shape
    D = attn.head_dim
    rec = recomputing()
    mode, stash = ckpt.stash_mode()
    skip_qkv = rec and mode == "replay" and stash.pending() and stash.qkv
    x, h = norm_residual(layer.input_layernorm, h, arch.gemma_norm, impl)
    q, k, v = _group(x, (attn.q_proj, attn.k_proj, attn.v_proj), step, need_y=not skip_qkv)
    del x
    q, k, v = q.view(B, S, -1, D), k.view(B, S, -1, D), v.view(B, S, -1, D)
    if arch.qk_norm:
        q = norm(attn.q_norm, q, arch.gemma_norm, impl)
        k = norm(attn.k_norm, k, arch.gemma_norm, impl)
    cos, sin = step.rope[ltype if arch.rope_per_type else "full_attention"]
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, impl=impl)
    policy = "off"
    if mode == "record":
        params = sum(_in_out(m) for m in (
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.gate_proj,
            layer.mlp.up_proj, layer.mlp.down_proj))
        policy = stash.offloader.capped(  # within the host memory budget (Offloader.plan)
            stash_choice(B, S, h.shape[-1], q.shape[1] * D, k.shape[1] * D, params))
    o = attention(q, k, v.transpose(1, 2), step.mask[ltype], attn.scaling, arch.attn_softcap,
                  stash_qkv=not arch.qk_norm, stash_policy=policy)
    del q, k, v
    if not arch.sandwich:  # h + o_proj(o), the residual added in the GEMMs (none in a recompute)
        return _group(o, (attn.o_proj,), step, need_y=not rec, residual=h)[0]
    (o,) = _group(o, (attn.o_proj,), step)
    return h + norm(layer.post_attention_layernorm, o, True, impl)


def mlp_block(layer, h, step: StepInputs, arch: ArchSpec, impl: str):
    """h + [norm](mlp(norm(h))); in a recompute the MLP skips its down projection and the residual
    add (their output is the discarded block value), except with a sandwich norm, whose backward
    reads m."""
    pre = layer.pre_feedforward_layernorm if arch.sandwich else layer.post_attention_layernorm
    x, h = norm_residual(pre, h, arch.gemma_norm, impl)
    if not arch.sandwich:  # the residual is added in the down GEMM (none in a recompute)
        return _mlp(x, layer.mlp, arch.activation, impl, step, need_y=not recomputing(),
                    residual=h)
    m = _mlp(x, layer.mlp, arch.activation, impl, step)
    return h + norm(layer.post_feedforward_layernorm, m, True, impl)


def run_layer(layer, h, step: StepInputs, arch: ArchSpec, impl: str):
    """One decoder layer, h [B, S, H] in the compute dtype: :func:`attn_block` then
    :func:`mlp_block` (each is one checkpointed segment when the layer is checkpointed)."""
    return mlp_block(layer, attn_block(layer, h, step, arch, impl), step, arch, impl)


def step_inputs(model, arch: ArchSpec, h, position_ids, attention_mask,
                arange_positions: bool = False) -> StepInputs:
    """RoPE tables from the model's own rotary module and the masks, once per forward.
    ``arange_positions``: position_ids are arange(S) per row (no packing check, no sync)."""
    inner = model.model
    S = h.shape[1]
    rope = {}
    if arch.rope_per_type:
        for t in set(arch.layer_types):
            rope[t] = inner.rotary_emb(h, position_ids, t)
    else:
        rope["full_attention"] = inner.rotary_emb(h, position_ids)
    kind = mask_kind(None if arange_positions else position_ids, attention_mask, S)
    seg = None  # packed rows without padding on CUDA: FlashAttention varlen (worker/engine/varlen)
    if kind == (True, False) and h.is_cuda and varlen.ENABLED and arch.attn_softcap is None:
        seg = varlen.segments(position_ids)
    masks = {t: seg if seg is not None and arch.windows.get(t) is None else
             build_mask(position_ids, attention_mask, S, arch.windows.get(t), h.device, kind)
             for t in set(arch.layer_types)}
    plan = getattr(getattr(model, "_whetstone", None), "cast_plan", None)
    return StepInputs(rope, masks, CastCache(plan))
