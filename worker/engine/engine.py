"""The LoRA/QLoRA engine: load, inject LoRA (PEFT layout), quantise to NF4, plug in the fused path.

Flow (``prepare``): a HF causal LM -> ``peft.get_peft_model`` with the run's LoraConfig (names and
layout exactly PEFT's, so ``save_pretrained`` writes a normal adapter) -> with ``load_in_4bit`` every
LoRA-wrapped frozen base linear becomes an :class:`~worker.engine.quant.NF4Linear` (bitsandbytes
layout; a pre-quantised bnb-4bit checkpoint is converted as is) -> :func:`patch` sets ``forward`` on
*this* HF model instance (no library class is touched).

The patched forward (:func:`engine_forward`) runs the fused path when it is given ``labels`` (training
and evaluation loss): embeddings -> per layer :func:`~worker.engine.patch.run_layer`, checkpointed
(offloaded to pinned host memory on CUDA) except the layers the VRAM budget lets keep their
activations -> final norm -> fused LM head + cross-entropy (whetstone_kernels.cross_entropy; logits never
materialised; ``num_items_in_batch`` normalises per token across gradient accumulation exactly as
transformers' loss does). It returns ``CausalLMOutputWithPast(loss=..., logits=None)``. Without labels
(generation, a KV cache) it calls the model's original forward, which runs PEFT's modules (and
NF4Linear bases) unchanged; :mod:`worker.engine.gencache` keeps those bases dequantised once per
generation phase.

Backward of the checkpointed layers (:mod:`~worker.engine.checkpointing`): each layer is two
checkpointed segments (attention block, MLP block; :mod:`~worker.engine.patch`). Loads start the
H2D copies of the saves backward reaches next on a side stream (one prefetch chain per forward,
started here; the last saves' copies start when the forward leaves the stack), so the copies
overlap the recompute. The recompute skips the o_proj and down_proj base GEMMs, whose outputs only
feed a discarded segment output (not for sandwich-norm archs), and the attention segment may reuse
what its forward stashed (:mod:`~worker.engine.attention`).

:func:`hidden_states` is the same fused stack without the head: final-normed h [B, S, H] in the
compute dtype. GRPO's policy and reference log-probs (:mod:`worker.engine.logps`) run through it.
``EngineState.fused_calls`` counts fused stack runs (tests assert the path is taken).
"""
from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from worker.engine import checkpointing as ckpt
from worker.engine.lora_casts import CastPlan
from worker.engine.patch import (ArchSpec, Unsupported, arch_spec, attn_block, mlp_block, norm,
                                 run_layer, step_inputs)

log = logging.getLogger("worker.engine")


@dataclass
class EngineState:
    arch: ArchSpec
    impl: str
    checkpointing: bool
    vram_budget_gib: float | None
    offloader: ckpt.Offloader
    orig_forward: Callable
    preserve_rng: bool
    kept_layers: int = 0
    fused_calls: int = 0
    notes: list[str] = field(default_factory=list)
    cast_plan: CastPlan = field(default_factory=CastPlan)


def default_impl() -> str:
    return "triton" if torch.cuda.is_available() else "reference"


def lora_config(spec) -> Any:
    """PEFT LoraConfig from a TrainSpec-like object (r, lora_alpha, lora_dropout, target_modules,
    use_rslora; bias "none")."""
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                      target_modules=list(spec.target_modules), use_rslora=spec.use_rslora,
                      bias="none", task_type="CAUSAL_LM")


def load_model(model_dir: str, load_in_4bit: bool, device: str | torch.device,
               dtype: torch.dtype | None = None):
    """The base causal LM on ``device`` in ``dtype`` (bf16 on CUDA, fp32 on CPU by default).

    A checkpoint that is already bitsandbytes-4bit is loaded by transformers (CUDA) and converted by
    ``prepare``. With ``load_in_4bit`` the dense weights are loaded on the CPU and quantised one
    layer at a time onto ``device`` in ``prepare`` (so the GPU never holds the dense model).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = AutoConfig.from_pretrained(model_dir)
    preq = getattr(cfg, "quantization_config", None)
    if preq and device.type == "cuda":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": device.index or 0})
    stage = "cpu" if load_in_4bit else device
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": stage}
                                                 if device.type == "cuda" else None)
    return model


def prepare(model, spec, *, load_in_4bit: bool = False, impl: str | None = None,
            device=None, checkpointing: bool = True, vram_budget_gib: float | None = None,
            offload: bool = True, on_log: Callable[[str], None] | None = None):
    """Inject LoRA, quantise, patch. Returns the PeftModel (trainable: the LoRA A/B only).

    LoRA weights are kept in fp32 (master weights for the optimiser); the fused functions compute in
    the activations' dtype. ``on_log`` receives one line per decision (arch, fallbacks, budget).
    """
    from peft import get_peft_model

    from worker.engine.quant import quantize_lora_bases

    say = on_log or log.info
    impl = impl or default_impl()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    for p in model.parameters():
        p.requires_grad_(False)
    pm = get_peft_model(model, lora_config(spec))
    quantised = any(getattr(getattr(m, "weight", None), "quant_state", None) is not None
                    for m in model.modules())
    if load_in_4bit or quantised:
        n = quantize_lora_bases(pm, impl, device)
        say(f"engine: {n} base linear layers held as NF4 (bitsandbytes layout, double-quantised)")
    pm.to(device)
    for n_, p in pm.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
    patch(pm.get_base_model(), impl, checkpointing=checkpointing,
          vram_budget_gib=vram_budget_gib, offload=offload,
          preserve_rng=spec.lora_dropout > 0, on_log=say)
    return pm


def patch(model, impl: str, *, checkpointing=True, vram_budget_gib=None, offload=True,
          preserve_rng=False, on_log=None) -> EngineState | None:
    """Set the fused forward on this HF model instance; None (and a log line) when unsupported."""
    say = on_log or log.info
    try:
        arch = arch_spec(model)
    except Unsupported as e:
        say(f"engine: {e}; training with PEFT's plain modules (no fused kernels)")
        return None
    host = host_budget_bytes() if offload else None
    st = EngineState(arch, impl, checkpointing, vram_budget_gib,
                     ckpt.Offloader(offload, host, on_log=say), model.forward, preserve_rng)
    model._whetstone = st
    model.forward = types.MethodType(engine_forward, model)
    say(f"engine: fused {arch.model_type} path, impl={impl}, checkpointing="
        f"{'on' if checkpointing else 'off'}"
        + (f", VRAM budget {vram_budget_gib} GiB" if vram_budget_gib else "")
        + (", activations offloaded to pinned CPU memory"
           + (f" (host budget {host / 2**30:.1f} GiB)" if host is not None else "")
           if st.offloader.enabled else ""))
    return st


def host_budget_bytes() -> int | None:
    """Pinned host memory the offloaded activations may take: ``WHETSTONE_OFFLOAD_HOST_GIB``
    (GiB; "none" for no limit), else half the host memory available when the engine is built
    (MemAvailable of /proc/meminfo; None where it cannot be read). Other jobs on the box keep the
    other half, and a job started later sees what this one left."""
    raw = os.environ.get("WHETSTONE_OFFLOAD_HOST_GIB", "").strip().lower()
    if raw in ("none", "inf"):
        return None
    if raw:
        return int(float(raw) * 2**30)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return None


def unpatch(model) -> None:
    st = getattr(model, "_whetstone", None)
    if st is not None:
        del model.forward
        del model._whetstone


def _kept_layers(model, st: EngineState, tokens: int, dtype) -> int:
    if not st.checkpointing:
        return len(model.model.layers)
    if st.vram_budget_gib is None or not torch.cuda.is_available():
        return 0
    cfg = model.config
    per = ckpt.layer_activation_bytes(cfg, tokens, torch.finfo(dtype).bits // 8)
    inter = cfg.intermediate_size * cfg.hidden_size * (torch.finfo(dtype).bits // 8)
    transient = per + (512 << 20) + 2 * inter + (1 << 30)
    return ckpt.plan_layers(len(model.model.layers), per, st.vram_budget_gib * (1 << 30),
                            torch.cuda.memory_allocated(), transient)


def engine_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                   inputs_embeds=None, past_key_values=None, use_cache=None,
                   num_items_in_batch=None, **kwargs):
    """The fused training forward (see the module docstring); original forward without labels."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    st: EngineState = self._whetstone
    if labels is None or past_key_values is not None or use_cache:
        return st.orig_forward(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, labels=labels,
                               inputs_embeds=inputs_embeds, past_key_values=past_key_values,
                               use_cache=use_cache, **kwargs)
    h = hidden_states(self, input_ids, attention_mask, position_ids, inputs_embeds)
    loss = causal_lm_loss(self, h, labels, num_items_in_batch, st)
    return CausalLMOutputWithPast(loss=loss, logits=None)


def engine_state(model) -> EngineState | None:
    """The EngineState of a patched HF model or of the PeftModel around it; None if unpatched."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "_whetstone", None)


def hidden_states(model, input_ids=None, attention_mask=None, position_ids=None,
                  inputs_embeds=None) -> torch.Tensor:
    """Final-normed hidden states [B, S, H] of the patched HF model ``model`` via the fused layers.

    input_ids [B, S] int64 (or inputs_embeds [B, S, H]); attention_mask [B, S] 0/1 (left or right
    padding; padded keys are masked); position_ids [B, S] default arange(S) as HF's forward does.
    Layers are checkpointed (budget / offload as for SFT) when grad is on and the model trains.
    Active LoRA adapters are fused; with adapters disabled each projection is the frozen base only.
    """
    st: EngineState = model._whetstone
    inner = model.model
    h = inputs_embeds if inputs_embeds is not None else inner.embed_tokens(input_ids)
    B, S, H = h.shape
    arange = position_ids is None
    if arange:
        position_ids = torch.arange(S, device=h.device).expand(B, S)
    step = step_inputs(model, st.arch, h, position_ids, attention_mask, arange)
    kept = _kept_layers(model, st, B * S, h.dtype)
    st.kept_layers = kept
    st.fused_calls += 1
    use_ckpt = st.checkpointing and torch.is_grad_enabled() and model.training
    if use_ckpt:  # the checkpointed layers below are one prefetch chain (backward: i -> i-1)
        st.offloader.start_chain()
        cfg = model.config
        hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        st.offloader.plan(len(inner.layers) - kept, B * S, H, cfg.num_attention_heads * hd,
                          getattr(cfg, "num_key_value_heads", cfg.num_attention_heads) * hd)
    for i, layer in enumerate(inner.layers):
        if use_ckpt and i >= kept:  # two segments: attention (stashes its output), MLP
            for j, block in enumerate((attn_block, mlp_block)):
                fn = partial(block, layer, step=step, arch=st.arch, impl=st.impl)
                h = ckpt.checkpoint_layer(fn, h, st.offloader, (i, j), st.preserve_rng)
        else:
            h = run_layer(layer, h, step, st.arch, st.impl)
    if use_ckpt:  # the last layer's input comes back while the head and loss run
        st.offloader.prefetch_last()
    return norm(inner.norm, h, st.arch.gemma_norm, st.impl)


def causal_lm_loss(model, h, labels, num_items_in_batch, st: EngineState):
    """transformers' ForCausalLMLoss semantics (shift inside, -100 ignored, sum / num_items when
    given, else mean) through the fused LM head + cross-entropy."""
    import torch.nn.functional as F

    from whetstone_kernels.cross_entropy import linear_cross_entropy

    shift = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(h.device)
    hidden = h.reshape(-1, h.shape[-1])
    head = model.lm_head
    if num_items_in_batch is not None:
        red, normaliser = "sum", num_items_in_batch
        if torch.is_tensor(normaliser):
            normaliser = normaliser.to(h.device)
    else:
        red, normaliser = "mean", None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        logits = head(hidden).float()
        if st.arch.final_softcap:
            logits = torch.tanh(logits / st.arch.final_softcap) * st.arch.final_softcap
        loss = F.cross_entropy(logits, shift, ignore_index=-100, reduction=red)
        return loss / normaliser if red == "sum" else loss
    return linear_cross_entropy(hidden, head.weight, shift, softcap=st.arch.final_softcap,
                                reduction=red, normaliser=normaliser, impl=st.impl)
