"""LoRA/QLoRA supervised fine-tuning with transformers + PEFT + TRL's SFTTrainer.

The dataset arrives pre-tokenised (``input_ids`` + ``labels``) from :mod:`worker.engine.data`,
so TRL skips its own tokenisation and its collator pads our labels with -100.

Loss normalisation: transformers' Trainer counts the label tokens of *all* micro-batches of an
optimizer step (``num_items_in_batch``) and the model's loss divides the summed token losses by
that count, so the accumulated gradient is the gradient of the mean token loss over the whole
effective batch, whatever the micro-batch lengths (asserted in tests/worker/test_sft_engine.py).
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from worker import gpu

log = logging.getLogger("worker.engine.sft")

EIGHT_BIT_OPTIMS = ("paged_adamw_8bit", "adamw_8bit")


def has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


def resolve_optim(optim: str, cuda: bool) -> tuple[str, str | None]:
    """The optimizer actually used and a warning when it had to fall back."""
    if optim in EIGHT_BIT_OPTIMS and not (cuda and has_bitsandbytes()):
        why = "no CUDA device" if not cuda else "bitsandbytes is not installed"
        return "adamw_torch", f"{optim} needs bitsandbytes on CUDA ({why}); using adamw_torch"
    return optim, None


def use_engine(cuda: bool) -> bool:
    """The kernel engine (worker/engine/engine.py) trains whenever CUDA is present."""
    return bool(cuda) and os.environ.get("WHETSTONE_ENGINE", "1") != "0"


def load_model(model_dir: str, load_in_4bit: bool, cuda: bool, engine: bool | None = None):
    """The base causal LM (fp32 on CPU, bf16/fp16 on CUDA, NF4 with ``load_in_4bit``).

    On CUDA the engine loads it (dense weights are quantised to NF4 in :func:`add_lora`), unless
    ``engine`` is False (a plain transformers model, e.g. for a PEFT adapter loaded from disk).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if use_engine(cuda) if engine is None else (engine and cuda):
        if load_in_4bit and not has_bitsandbytes():
            raise RuntimeError("QLoRA (load_in_4bit) needs the bitsandbytes package")
        from worker.engine import engine

        return engine.load_model(model_dir, load_in_4bit, gpu.cuda_device())

    kwargs: dict[str, Any] = {}
    if load_in_4bit:
        if not cuda:
            raise RuntimeError("QLoRA (load_in_4bit) needs a CUDA GPU and bitsandbytes; this "
                               "worker runs on the CPU. Turn load_in_4bit off to train in full "
                               "precision.")
        if not has_bitsandbytes():
            raise RuntimeError("QLoRA (load_in_4bit) needs the bitsandbytes package")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    if cuda:
        kwargs["dtype"] = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        kwargs["device_map"] = {"": gpu.local_index()}
    else:
        kwargs["dtype"] = torch.float32
    from worker.hf_attention import attn_kwargs

    kwargs.update(attn_kwargs(model_dir))  # Gemma 2: sdpa would drop its attention soft-cap
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    return model


def load_tokenizer(model_dir: str, template: str | None):
    """The HF tokenizer (for saving with the adapter) with a pad token and the run's template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token or tok.eos_token
    if template:
        tok.chat_template = template
    return tok


def add_lora(model, spec, on_log: Callable[[str], None] | None = None,
             new_token_ids: list[int] | None = None) -> Any:
    """Wrap ``model`` with PEFT LoRA adapters named as PEFT does.

    On CUDA the engine does it: same PEFT layout, NF4 bases with ``load_in_4bit``, fused kernels,
    budgeted checkpointing (``spec.vram_budget_gib``); ``on_log`` gets its decisions.
    ``new_token_ids``: embedding rows of added tokens (:mod:`worker.engine.new_tokens`), trained
    with PEFT's ``trainable_token_indices`` (transformers path only: the engine raises).
    """
    from peft import LoraConfig, get_peft_model

    from worker.engine.new_tokens import trainable_token_indices

    if use_engine(gpu.cuda_available()):
        if new_token_ids:
            raise RuntimeError("training added tokens (trainable_token_indices) is not supported "
                               "by the kernel engine; set WHETSTONE_ENGINE=0")
        from worker.engine import engine

        try:
            return engine.prepare(model, spec, load_in_4bit=spec.load_in_4bit,
                                  device=gpu.cuda_device(),
                                  vram_budget_gib=spec.vram_budget_gib, on_log=on_log)
        except ValueError as e:
            raise RuntimeError(f"LoRA target_modules {spec.target_modules} do not match this "
                               f"model: {e}") from e

    cfg = LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                     target_modules=list(spec.target_modules), use_rslora=spec.use_rslora,
                     bias="none", task_type="CAUSAL_LM",
                     trainable_token_indices=trainable_token_indices(new_token_ids or [], model))
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if "." in n})
        raise RuntimeError(f"LoRA target_modules {spec.target_modules} do not match this model: "
                           f"{e}. Module names include: {', '.join(names[:30])}") from e


def sft_config(spec, output_dir: str, cuda: bool, optim: str, **overrides: Any):
    """TRL SFTConfig from a TrainSpec (standard transformers/TRL argument names)."""
    import torch
    from trl import SFTConfig

    warmup = min(spec.warmup_ratio, 0.999)  # transformers 5: a float < 1 is a ratio of all steps
    kw: dict[str, Any] = dict(
        output_dir=output_dir, packing=spec.packing, padding_free=spec.padding_free,
        # rows are already cut to max_seq_length (worker.engine.data); TRL refuses a max_length
        # with padding_free and no packing
        max_length=None if spec.padding_free and not spec.packing else spec.max_seq_length,
        per_device_train_batch_size=spec.per_device_train_batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps,
        learning_rate=spec.learning_rate, num_train_epochs=spec.num_train_epochs,
        max_steps=spec.max_steps, warmup_steps=warmup, lr_scheduler_type=spec.lr_scheduler_type,
        weight_decay=spec.weight_decay, max_grad_norm=spec.max_grad_norm, optim=optim,
        seed=spec.seed, data_seed=spec.seed, logging_steps=spec.logging_steps,
        save_strategy="steps", save_steps=spec.save_steps, save_total_limit=2,
        report_to="none", disable_tqdm=True, use_cpu=not cuda,
        bf16=bool(cuda and torch.cuda.is_bf16_supported()),
        fp16=bool(cuda and not torch.cuda.is_bf16_supported()),
        gradient_checkpointing=bool(cuda), include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0, dataloader_pin_memory=cuda, average_tokens_across_devices=True,
        remove_unused_columns=True,
    )
    kw.update(ddp_arguments(spec.gradient_accumulation_steps, cuda))
    kw.update(overrides)
    return SFTConfig(**kw)


def ddp_arguments(accumulation_steps: int, cuda: bool) -> dict[str, Any]:
    """TrainingArguments of a data-parallel rank (worker/ddp.py; {} in a 1-process run): each
    of the ``WORLD_SIZE`` ranks runs ``accumulation_steps / WORLD_SIZE`` micro-batches of every
    optimizer step, so the effective batch is the 1-process run's; accelerate hands rank r the
    micro-batches r, r + WORLD_SIZE, ... of the same seeded order, and the loss is divided by
    the label tokens of the whole step on all ranks (``average_tokens_across_devices``), so the
    all-reduced gradient is the 1-process run's. NCCL on GPUs, gloo on the CPU."""
    from worker.ddp import world_size

    world = world_size()
    if world <= 1:
        return {}
    if accumulation_steps % world:
        raise RuntimeError(f"gradient_accumulation_steps ({accumulation_steps}) must be a "
                           f"multiple of num_gpus ({world})")
    return dict(gradient_accumulation_steps=accumulation_steps // world,
                ddp_backend="nccl" if cuda else "gloo", ddp_find_unused_parameters=False,
                gradient_checkpointing_kwargs={"use_reentrant": False},
                average_tokens_across_devices=True)


def make_trainer(model, tokenizer, train_dataset, args, callbacks=(), eval_dataset=None):
    """An SFTTrainer over a pre-tokenised dataset (and held-out ``eval_dataset``, if any).

    TRL computes its loss through a Triton fused LM head, which needs a GPU; off CUDA the loss is
    transformers' own ``Trainer.compute_loss`` (the model's token-summed cross-entropy divided
    by ``num_items_in_batch``), the same normalisation.
    """
    from transformers import Trainer
    from trl import SFTTrainer

    class _CpuSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs["use_cache"] = False
            return Trainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    # The engine returns the fused loss and no logits, so Trainer.compute_loss drives it too.
    engine_on = getattr(getattr(model, "get_base_model", lambda: model)(), "_whetstone", None)
    _quiet_flat_batch_warnings()
    cls = SFTTrainer if args.use_cpu is False and _on_cuda(model) and engine_on is None \
        else _CpuSFTTrainer
    return cls(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
               processing_class=tokenizer, callbacks=list(callbacks))


_FLAT_WARNINGS = ("Padding-free training is enabled, but the attention implementation",
                  "You are using packing, but the attention implementation")


class _FlatBatchFilter:
    """Drops TRL's warning that padding-free/packed batches need a FlashAttention model: the
    engine runs FlashAttention-2 varlen (worker/engine/varlen.py) and transformers' sdpa/eager
    masks restart at each position_ids reset, so attention stays inside each row either way
    (tests/worker/test_sft_engine.py, tests/gpu/test_attention_gpu.py). With padding-free
    batches the default, the warning would otherwise open every run's worker log."""

    @staticmethod
    def filter(record) -> bool:
        msg = record.getMessage()
        return not any(w in msg for w in _FLAT_WARNINGS)


def _quiet_flat_batch_warnings() -> None:
    import logging

    log = logging.getLogger("trl.trainer.sft_trainer")
    if not any(isinstance(f, _FlatBatchFilter) for f in log.filters):
        log.addFilter(_FlatBatchFilter())


def _on_cuda(model) -> bool:
    try:
        return next(model.parameters()).device.type == "cuda"
    except StopIteration:
        return False


def progress_callback(metric: Callable[..., None], stop_reason: Callable[[], str | None],
                      on_stop: Callable[[str], None] | None = None):
    """A TrainerCallback that reports metric events and stops on cancel/lease loss/shutdown.

    ``stop_reason()`` returns ``cancelled`` | ``lost`` | ``shutdown`` | None; on ``shutdown``
    the trainer also saves a checkpoint before it stops (so a requeued job resumes).
    """
    from worker.engine.callbacks import stopping_callback

    class _Callback(stopping_callback()):
        def __init__(self):
            super().__init__(stop_reason, on_stop)
            self.last_t = self.t0
            self.last_tokens = 0
            self.losses: list[tuple[int, float]] = []

        def on_train_begin(self, args, state, control, **kw):
            super().on_train_begin(args, state, control, **kw)
            self.last_t = self.t0
            self.last_tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0)

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if "loss" not in logs:
                return
            now = time.monotonic()
            tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            dt = max(now - self.last_t, 1e-9)
            tps = (tokens - self.last_tokens) / dt
            _, eta = self.step_timing(state, now)
            self.last_t, self.last_tokens = now, tokens
            mem, kind = gpu.memory()
            loss = float(logs["loss"])
            if math.isfinite(loss):
                self.losses.append((state.global_step, loss))
            metric(step=state.global_step, total_steps=state.max_steps, loss=loss,
                   learning_rate=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"),
                   tokens_per_second=round(tps, 2), eta_seconds=eta,
                   memory_gib=round(mem, 4), memory_kind=kind,
                   peak_gib=round(gpu.peak_gib(), 4), epoch=logs.get("epoch"),
                   tokens_seen=tokens)

    return _Callback()
