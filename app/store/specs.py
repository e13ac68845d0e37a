"""Versioned job payloads (pydantic): what a run or export asks the worker to do.

Field names are the ones users know from PEFT (``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules``, ``use_rslora``) and TRL/transformers (``learning_rate``,
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``num_train_epochs``,
``max_steps``, ``warmup_ratio``, ``lr_scheduler_type``, ``seed``, ``packing``,
``max_seq_length``). The worker saves the resolved spec as ``config.json`` in the run folder.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts",
              "polynomial", "inverse_sqrt")
OPTIMIZERS = ("adamw_torch", "paged_adamw_8bit", "adamw_8bit")


class TrainSpec(BaseModel):
    """A LoRA/QLoRA supervised fine-tuning run (spec_version 1).

    ``max_steps > 0`` overrides ``num_train_epochs`` (as in transformers' TrainingArguments).
    ``chat_template`` is either the name of a built-in default template or a Jinja string; None
    means the model's own template. Raises pydantic.ValidationError naming the field on bad input.
    """

    model_config = ConfigDict(extra="forbid")

    spec_version: Literal[1] = 1
    model: str = Field(description="registered model id or name")
    dataset: str = Field(description="dataset file id")
    dataset_format: str | None = Field(default=None, description="override format detection")
    r: int = Field(default=16, ge=1, le=1024)
    lora_alpha: int = Field(default=16, ge=1, le=4096)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_LINEAR), min_length=1)
    use_rslora: bool = False
    load_in_4bit: bool = False
    max_seq_length: int = Field(default=1024, ge=8, le=1_048_576)
    learning_rate: float = Field(default=2e-4, gt=0.0, le=1.0)
    num_train_epochs: float = Field(default=1.0, gt=0.0, le=1000.0)
    max_steps: int = Field(default=-1, ge=-1)
    per_device_train_batch_size: int = Field(default=2, ge=1, le=4096)
    gradient_accumulation_steps: int = Field(default=4, ge=1, le=4096)
    warmup_ratio: float = Field(default=0.03, ge=0.0, le=1.0)
    lr_scheduler_type: str = "linear"
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(default=1.0, ge=0.0)
    optim: str = "adamw_torch"
    seed: int = Field(default=3407, ge=0)
    train_on_responses_only: bool = True
    packing: bool = False
    chat_template: str | None = None
    system_prompt: str | None = None
    logging_steps: int = Field(default=1, ge=1)
    save_steps: int = Field(default=50, ge=1)
    vram_budget_gib: float | None = Field(default=None, gt=0)

    @field_validator("lr_scheduler_type")
    @classmethod
    def _scheduler(cls, v: str) -> str:
        if v not in SCHEDULERS:
            raise ValueError(f"must be one of {', '.join(SCHEDULERS)}")
        return v

    @field_validator("optim")
    @classmethod
    def _optim(cls, v: str) -> str:
        if v not in OPTIMIZERS:
            raise ValueError(f"must be one of {', '.join(OPTIMIZERS)}")
        return v

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        cleaned = [m.strip() for m in v if m and m.strip()]
        if not cleaned:
            raise ValueError("name at least one module, e.g. q_proj")
        return cleaned

    @model_validator(mode="after")
    def _steps(self) -> "TrainSpec":
        if self.max_steps == 0:
            raise ValueError("max_steps must be -1 (use num_train_epochs) or a positive number")
        return self


class ExportSpec(BaseModel):
    """Export a run's result (spec_version 1): adapter, merged 16-bit, GGUF or Ollama."""

    model_config = ConfigDict(extra="forbid")

    spec_version: Literal[1] = 1
    run_id: str
    format: Literal["adapter", "merged_16bit", "gguf", "ollama"]
    quantization: list[str] = Field(default_factory=list)
    dtype: Literal["bf16", "fp16"] = "bf16"


class ImportModelSpec(BaseModel):
    """Make a registered model ready: download from the Hub, copy a folder, or convert llama2.c."""

    model_config = ConfigDict(extra="forbid")

    spec_version: Literal[1] = 1
    model_id: str
