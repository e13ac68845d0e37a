"""Peak GPU memory of a job, estimated from the model's shape and the run's spec (pure Python).

The figures follow what the engine (``worker/engine``) allocates on a CUDA GPU, in GiB (2**30
bytes). The *allocator peak* (``allocated_gib``) is what ``torch.cuda.max_memory_allocated``
reports; ``total_gib`` adds the CUDA context, which lives outside torch's allocator.

* **weights**: the 7 linear projections of every decoder layer in NF4 (4 bits a weight, a uint8
  absmax per 64 weights, an fp32 absmax-of-absmax per 256 blocks) with ``load_in_4bit``, else
  bf16; embeddings, LM head (unless tied) and norms in bf16.
* **adapter + optimizer**: LoRA A and B of every targeted projection in fp32 (master weights), their
  fp32 gradients, and AdamW's two moments (fp32, or 1 byte each for the 8-bit optimizers).
* **activations**: the layers the VRAM budget lets keep their activations on the GPU (the engine's
  own planning rule, :func:`kept_layers`), plus the working set of one layer being recomputed and
  back-propagated and the residual stream (hidden states, their gradient, the prefetched input of
  the next offloaded layer). Without a budget every layer is checkpointed and offloaded.
* **logits**: the fused LM head + cross-entropy works on chunks of at most 512 MiB of bf16 logits
  and saves ``dh`` (SFT); GRPO's log-prob pass holds a 256 MiB fp32 chunk, its log-softmax and the
  backward's copy.
* **workspace**: cuBLAS/cuBLASLt GEMM workspaces, taken once through torch's allocator and held
  for the process's life, so present in every phase (:data:`GEMM_WORKSPACE_GIB`).
* **kv cache** (GRPO): the rollouts' cache, ``rows x (max_prompt_length + max_completion_length)``
  tokens x layers x 2 (K and V) x kv heads x head_dim in bf16, plus a decode step's logits.

These phases do not overlap in time: backward through the layers, the loss, and (GRPO)
generation each come and go, while the kept activations stay. So the allocator peak is
``weights + adapter_optimizer + workspace + kept activations + the largest phase``; ``peak_phase`` names it.
Measured peaks correct the result (:mod:`app.studio.calibration`); the constants below were
checked against the H200 peaks in ``bench/results.jsonl`` (tests/studio/test_estimate.py states
the error per row).

Exports (merged 16-bit, GGUF) and imports run on the CPU: 0 GiB of GPU memory.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

GIB = 1 << 30
#: NF4 bytes a weight: 4-bit codes + uint8 absmax per 64 weights + fp32 second-level absmax per
#: 256 blocks (bitsandbytes' double quantisation layout).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
#: CUDA context + cuBLAS/cuDNN handles outside torch's allocator (not in max_memory_allocated).
#: An allowance, not measured by the benchmark rows (they report the allocator only).
CUDA_CONTEXT_GIB = 0.5
#: GEMM workspaces (cuBLAS + cuBLASLt) held by torch's allocator from the first matmul on, in
#: every phase. Measured: stories260K's allocator peak (0.070 GiB, H200 call s15-c3) less its
#: tensors (0.006 GiB) is 0.064 GiB, i.e. two 32 MiB workspaces; model-size independent.
GEMM_WORKSPACE_GIB = 1 / 16
#: Besides activations, the layer in flight holds one weight-shaped bf16 transient the size of
#: its largest projection (the dequantised NF4 weight; fitted on the 8B rows, where this plus the
#: workspace, 0.172 GiB, replaced an older flat 0.18 GiB that made a 260K model's estimate +165 %).
IN_FLIGHT_WEIGHTS = 1
#: Residual-stream tensors live during backward, in hidden-size bf16 vectors a token.
RESIDUAL_VECTORS = 6
#: GRPO holds a little more after load than SFT (measured 5.62 vs 5.47 GiB on Llama-3.1-8B QLoRA).
GRPO_EXTRA_GIB = 0.15
SFT_CE_CHUNK_BYTES = 512 << 20  # whetstone_kernels/cross_entropy.py
GRPO_LOGPS_CHUNK_BYTES = 256 << 20  # worker/engine/logps.py (x3: logits, log-softmax, backward)
EIGHT_BIT_OPTIMS = ("paged_adamw_8bit", "adamw_8bit")
TRAINING_KINDS = ("train", "grpo")


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the estimate needs (from the model's config.json)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "ModelShape | None":
        """From a HF config dict (or its ``text_config``), or from a Model row's ``info`` (keys
        ``layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``vocab``, ``tie_word_embeddings``); None when a
        number is missing."""
        c = cfg.get("text_config") or cfg
        layers = c.get("num_hidden_layers", c.get("layers"))
        hidden, heads = c.get("hidden_size"), c.get("num_attention_heads")
        inter, vocab = c.get("intermediate_size"), c.get("vocab_size", c.get("vocab"))
        if not all(isinstance(v, int) and v > 0 for v in (layers, hidden, heads, inter, vocab)):
            return None
        kv = c.get("num_key_value_heads") or heads
        hd = c.get("head_dim") or hidden // heads
        tied = c.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return cls(layers, hidden, inter, heads, int(kv), int(hd), vocab, bool(tied))

    def projections(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` of a decoder layer's linear projections."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, \
            self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def model_shape(info: dict[str, Any] | None, model_dir: str | None = None) -> ModelShape | None:
    """The shape from a Model row's ``info``, else from ``<model_dir>/config.json``; None when
    neither has the numbers (e.g. a model not imported yet)."""
    shape = ModelShape.from_config(info) if info else None
    if shape is None and model_dir:
        try:
            shape = ModelShape.from_config(json.loads((Path(model_dir) / "config.json").read_text()))
        except (OSError, ValueError, AttributeError):
            return None
    return shape


@dataclass
class Estimate:
    """A job's estimated peak GPU memory, in GiB, with its parts (see the module docstring)."""

    weights_gib: float = 0.0
    adapter_optimizer_gib: float = 0.0
    workspace_gib: float = 0.0  # GEMM workspaces (every phase)
    activations_gib: float = 0.0
    logits_gib: float = 0.0
    kv_cache_gib: float = 0.0
    context_gib: float = 0.0
    allocated_gib: float = 0.0  # the allocator peak (max_memory_allocated)
    total_gib: float = 0.0  # allocated + context: what the job needs of a GPU
    peak_phase: str = "none"  # layers | loss | generation | none (no GPU)
    tokens: int = 0  # tokens of one micro-batch
    kept_layers: int = 0
    correction: float = 1.0  # measured / estimated, from earlier jobs (1.0: uncalibrated)
    calibrated_from: int = 0  # how many earlier jobs the correction comes from
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict, GiB rounded to 0.01."""
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def corrected(self, factor: float, n: int) -> "Estimate":
        """This estimate scaled by ``factor`` (allocator parts only; the context is fixed)."""
        if n <= 0 or factor == 1.0:
            return self
        scale = ("weights_gib", "adapter_optimizer_gib", "workspace_gib", "activations_gib",
                 "logits_gib", "kv_cache_gib", "allocated_gib")
        out = replace(self, **{k: getattr(self, k) * factor for k in scale},
                      correction=factor, calibrated_from=n, notes=list(self.notes))
        out.total_gib = out.allocated_gib + out.context_gib
        return out


def layer_activation_bytes(s: ModelShape, tokens: int) -> int:
    """Bytes one decoder layer keeps for backward when not checkpointed (bf16), no margin:
    6 hidden vectors, K and V before and after RoPE, gate and up, fp32 logsumexp per head."""
    kv = s.kv_heads * s.head_dim
    return (((6 * s.hidden + 4 * kv + 2 * s.intermediate) * 2) + 4 * s.heads) * tokens


def kept_layers(s: ModelShape, tokens: int, budget_gib: float | None, in_use_bytes: float) -> int:
    """How many layers the engine keeps on the GPU under ``budget_gib`` (worker/engine/engine.py
    ``_kept_layers``: 15 % margin a layer, one recomputed layer + 1.5 GiB + two dequantised MLP
    weights of headroom); 0 without a budget."""
    if budget_gib is None:
        return 0
    per = math.ceil(layer_activation_bytes(s, tokens) * 1.15)
    transient = per + (512 << 20) + 2 * s.intermediate * s.hidden * 2 + GIB
    free = budget_gib * GIB - in_use_bytes - transient
    return max(0, min(s.layers, int(free // per)))


def lora_params(s: ModelShape, r: int, targets: list[str]) -> int:
    """Trainable LoRA parameters: r x (in + out) per targeted projection per layer (lm_head too
    when targeted)."""
    proj = s.projections()
    n = sum(r * sum(proj[t]) for t in targets if t in proj) * s.layers
    if "lm_head" in targets:
        n += r * (s.hidden + s.vocab)
    return n


def weight_bytes(s: ModelShape, four_bit: bool) -> float:
    """Bytes of the base weights on the GPU (NF4 projections with ``four_bit``, else bf16)."""
    linear = sum(i * o for i, o in s.projections().values()) * s.layers
    embed = s.vocab * s.hidden * (1 if s.tied else 2)
    norms = (2 * s.layers + 1) * s.hidden
    return linear * (NF4_BYTES if four_bit else 2) + (embed + norms) * 2


def estimate_training(s: ModelShape, spec: Any, kind: str = "train") -> Estimate:
    """Estimate a ``train`` (TrainSpec) or ``grpo`` (GrpoSpec) job's peak on one CUDA GPU.

    Micro-batch tokens: ``max_seq_length x per_device_train_batch_size`` (the longest batch;
    packing fills it exactly); GRPO: ``per_device_train_batch_size x (max_prompt_length +
    max_completion_length)``, generating ``per_device_train_batch_size x
    gradient_accumulation_steps`` completions at once.
    """
    four_bit = bool(getattr(spec, "load_in_4bit", False))
    w = weight_bytes(s, four_bit)
    n_lora = lora_params(s, spec.r, list(spec.target_modules))
    state = 2 if spec.optim in EIGHT_BIT_OPTIMS else 8  # Adam m + v per parameter
    adapter = n_lora * (4 + 4 + state)
    if kind == "grpo":
        seq = spec.max_prompt_length + spec.max_completion_length
        tokens = spec.per_device_train_batch_size * seq
    else:
        seq, tokens = spec.max_seq_length, spec.max_seq_length * spec.per_device_train_batch_size
    kept = kept_layers(s, tokens, spec.vram_budget_gib, w + n_lora * 4)
    layer = layer_activation_bytes(s, tokens)
    resident = kept * layer
    largest = max(i * o for i, o in s.projections().values()) * 2
    working = (layer if kept < s.layers else 0) + RESIDUAL_VECTORS * s.hidden * 2 * tokens \
        + IN_FLIGHT_WEIGHTS * largest
    workspace = GEMM_WORKSPACE_GIB * GIB
    hidden_bytes = s.hidden * 2 * tokens
    if kind == "grpo":
        rows = min(tokens, GRPO_LOGPS_CHUNK_BYTES // (4 * s.vocab)) or 1
        logits = 3 * rows * s.vocab * 4 + hidden_bytes
        resident += GRPO_EXTRA_GIB * GIB
        gen_rows = spec.per_device_train_batch_size * spec.gradient_accumulation_steps
        kv = gen_rows * seq * s.layers * 2 * s.kv_heads * s.head_dim * 2 + 2 * gen_rows * s.vocab * 4
    else:
        rows = max(1, min(tokens, SFT_CE_CHUNK_BYTES // (2 * s.vocab)))
        logits = rows * s.vocab * 2 + hidden_bytes + 8 * tokens
        kv = 0
    phases = {"layers": working, "loss": logits, "generation": kv}
    phase = max(phases, key=phases.get)
    allocated = w + adapter + workspace + resident + phases[phase]
    est = Estimate(weights_gib=w / GIB, adapter_optimizer_gib=adapter / GIB,
                   workspace_gib=workspace / GIB,
                   activations_gib=(resident + working) / GIB, logits_gib=logits / GIB,
                   kv_cache_gib=kv / GIB, context_gib=CUDA_CONTEXT_GIB,
                   allocated_gib=allocated / GIB, total_gib=allocated / GIB + CUDA_CONTEXT_GIB,
                   peak_phase=phase, tokens=tokens, kept_layers=kept)
    if spec.vram_budget_gib is not None:
        est.notes.append(f"{kept} of {s.layers} layers keep their activations on the GPU "
                         f"(vram_budget_gib {spec.vram_budget_gib:g})")
    return est


def estimate_job(kind: str, shape: ModelShape | None, spec: Any = None) -> Estimate | None:
    """The estimate for a job of ``kind``: training kinds from the shape and spec (None when the
    shape is unknown), exports and imports 0 GiB (they run on the CPU)."""
    if kind not in TRAINING_KINDS:
        return Estimate(notes=[f"{kind} runs on the CPU"])
    if shape is None or spec is None:
        return None
    return estimate_training(shape, spec, kind)


#: What a job's allocator estimate is for, in the words :func:`memory_words` uses, by job kind
#: (another user's job, whose kind a page does not show: "the job").
MEMORY_PURPOSE = {"train": "training", "grpo": "training", "evaluate": "evaluation",
                  "playground": "the model"}


def memory_words(allocated_gib: float | None, kind: str | None = "train",
                 admitted_gib: float | None = None,
                 margin: float | None = None, on_gpu: bool = True) -> dict[str, Any] | None:
    """How every page (run form, run page, queue) says a job's estimated GPU memory, so that
    they agree: ``allocated_gib`` (torch's allocator peak, GiB, as stored on the job) plus the
    CUDA context (:data:`CUDA_CONTEXT_GIB`), which lives outside the allocator.

    Returns None without an estimate, else ``{"total_gib", "allocated_gib", "context_gib",
    "short": "0.6 GiB on the GPU", "parts": "0.07 GiB for training + 0.5 GiB CUDA context",
    "text": "0.6 GiB on the GPU (0.07 GiB for training + 0.5 GiB CUDA context)",
    "admitted": ...}``. ``kind`` (job kind; None: another user's job) names what the allocator
    part is for. ``admitted_gib`` (what admission holds of a slot for the job,
    :func:`app.store.admission.need_gib`, computed there and only there) with ``margin`` (the
    ``gpu_admit_margin`` it was computed with) gives ``admitted``, e.g. ``"admitted as 0.6 GiB
    (0.07 GiB + 25% admission margin + 0.5 GiB CUDA context)"``; None without them.

    ``on_gpu`` False: the job runs (or, on a box without a GPU, will run) on a CPU slot, one
    job at a time in host memory, so no GPU, CUDA context or admission margin applies: the
    words say what the estimate is, e.g. ``short`` "0.07 GiB estimated", ``parts`` "the GPU
    estimate for training; a CPU slot runs it in host memory" (trial s25: a CPU box's queue
    read "0.6 GiB on the GPU ... + 0.5 GiB CUDA context")."""
    if allocated_gib is None:
        return None
    if not on_gpu:
        what = MEMORY_PURPOSE.get(kind, "the job") if kind else "the job"
        short = f"{allocated_gib:.2f} GiB estimated"
        parts = f"the GPU estimate for {what}; a CPU slot runs it in host memory"
        return {"total_gib": round(allocated_gib, 4), "allocated_gib": allocated_gib,
                "context_gib": 0.0, "short": short, "parts": parts,
                "text": f"{short} ({parts})", "admitted": None}
    total = allocated_gib + CUDA_CONTEXT_GIB
    what = MEMORY_PURPOSE.get(kind, "the job") if kind else "the job"
    short = f"{total:.1f} GiB on the GPU"
    parts = f"{allocated_gib:.2f} GiB for {what} + {CUDA_CONTEXT_GIB:.1f} GiB CUDA context"
    admitted = None
    if admitted_gib is not None and margin is not None:
        admitted = (f"admitted as {admitted_gib:.1f} GiB ({allocated_gib:.2f} GiB + "
                    f"{margin:.0%} admission margin + {CUDA_CONTEXT_GIB:.1f} GiB CUDA context)")
    return {"total_gib": round(total, 4), "allocated_gib": allocated_gib,
            "context_gib": CUDA_CONTEXT_GIB, "short": short, "parts": parts,
            "text": f"{short} ({parts})", "admitted": admitted}
