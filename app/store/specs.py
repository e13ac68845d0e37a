"""Versioned job payloads (pydantic): what a run or export asks the worker to do.

Field names are the ones users know from PEFT (``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules``, ``use_rslora``) and TRL/transformers (``learning_rate``,
``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``num_train_epochs``,
``max_steps``, ``warmup_ratio``, ``lr_scheduler_type``, ``seed``, ``packing``, ``padding_free``,
``max_seq_length``). The worker saves the resolved spec as ``config.json`` in the run folder.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts",
              "polynomial", "inverse_sqrt")
# GGUF types: written directly with the gguf package, and made by llama.cpp's quantiser.
GGUF_WRITTEN_TYPES = ("F32", "F16", "BF16", "Q8_0")
GGUF_QUANTIZER_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M",
                        "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "TQ1_0", "TQ2_0")
GGUF_TYPES = GGUF_WRITTEN_TYPES + GGUF_QUANTIZER_TYPES
OPTIMIZERS = ("adamw_torch", "paged_adamw_8bit", "adamw_8bit")
#: The smallest learning rate a run takes: below it (recipes go down to about 1e-7) the
#: adapter does not move; forms, ``/api`` and ``/v1``'s ``learning_rate_multiplier`` refuse it.
MIN_LEARNING_RATE = 1e-8


def field_bound(cls: type[BaseModel], name: str, bound: str = "le") -> Any:
    """The ``bound`` (``"ge"``, ``"le"``, ``"gt"`` or ``"lt"``) that ``cls``'s field ``name``
    declares (``Field(le=...)``), or None: the one place forms and messages read a limit from."""
    return next((getattr(m, bound) for m in cls.model_fields[name].metadata
                 if getattr(m, bound, None) is not None), None)


def one_of(field: str, choices: tuple[str, ...]):
    """A pydantic validator for ``field`` that accepts only ``choices`` ("must be one of ...")."""

    def check(cls, v: str) -> str:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return v

    return field_validator(field)(check)


def _is_number(annotation) -> bool:
    """Whether a field's type is int or float (or one of them | None)."""
    import typing

    args = typing.get_args(annotation) or (annotation,)
    return any(a in (int, float) for a in args) and bool not in args


class NumbersNotBooleans(BaseModel):
    """Refuses ``true``/``false`` for a number field (pydantic's lax mode reads them as 1/0,
    so ``"per_device_train_batch_size": true`` would train with 1): "must be a number, not
    true"."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value, info):
        field = cls.model_fields.get(info.field_name)
        if isinstance(value, bool) and field is not None and _is_number(field.annotation):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


class LoraTrainingFields(NumbersNotBooleans):
    """The fields and checks every LoRA/QLoRA training spec shares (PEFT + optimizer + trainer).

    Subclasses redeclare a field only to change its default or bounds (GrpoSpec's optimizer
    defaults differ from SFT's); the validators apply to whichever declaration is in force.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    spec_version: Literal[1] = 1
    model: str = Field(description="registered model id or name")
    dataset: str = Field(description="dataset file id")
    r: int = Field(default=16, ge=1, le=1024)
    lora_alpha: int = Field(default=16, ge=1, le=4096)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_LINEAR))  # _targets: >= 1
    use_rslora: bool = False
    load_in_4bit: bool = False
    learning_rate: float = Field(default=2e-4, ge=MIN_LEARNING_RATE, le=1.0)
    max_steps: int = Field(default=-1, ge=-1, le=10_000_000)
    per_device_train_batch_size: int = Field(default=2, ge=1, le=4096)
    gradient_accumulation_steps: int = Field(default=4, ge=1, le=4096)
    num_gpus: int = Field(
        default=1, ge=1, le=64, description="GPUs of one host the run trains on at once "
        "(data-parallel through torchrun): each GPU runs per_device_train_batch_size rows "
        "(GRPO: completions) and gradient_accumulation_steps / num_gpus micro-batches of every "
        "optimizer step, so the effective batch, the loss and the steps are those of the 1-GPU "
        "run")
    warmup_ratio: float = Field(default=0.03, ge=0.0, le=1.0)
    lr_scheduler_type: str = "linear"
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    max_grad_norm: float = Field(default=1.0, ge=0.0)
    optim: str = "adamw_torch"
    seed: int = Field(default=3407, ge=0, le=2**32 - 1)  # numpy/torch seed a run with a 32-bit seed
    chat_template: str | None = None
    chat_template_name: str | None = Field(
        default=None, description="set when the run is created: the resolved template's name "
        "(a built-in, 'model', 'custom' or 'none'); chat_template then holds its source")
    system_prompt: str | None = None
    logging_steps: int = Field(default=1, ge=1)
    save_steps: int = Field(default=50, ge=1)
    vram_budget_gib: float | None = Field(default=None, gt=0)

    _scheduler = one_of("lr_scheduler_type", SCHEDULERS)
    _optim = one_of("optim", OPTIMIZERS)

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        cleaned = [m.strip() for m in v if m and m.strip()]
        if not cleaned:
            raise ValueError("name at least one module, e.g. q_proj")
        return cleaned


class HeldOutFields(NumbersNotBooleans):
    """A run's held-out set (SFT and GRPO): OpenAI's ``validation_file`` or a percentage of the
    dataset's rows shuffled with the run's ``seed``; the rules in :mod:`app.studio.evaluation`."""

    validation_file: str | None = Field(
        default=None, description="dataset file id of the held-out set (OpenAI's "
        "validation_file), read like the training rows")
    validation_split_percentage: float = Field(
        default=0.0, ge=0.0, le=50.0, description="percent of the dataset's rows held out "
        "(shuffled with seed) when there is no validation_file; 0 = none")

    @property
    def has_held_out(self) -> bool:
        """Whether the run evaluates on a held-out set."""
        return bool(self.validation_file) or self.validation_split_percentage > 0


class TrainSpec(HeldOutFields, LoraTrainingFields):
    """A LoRA/QLoRA supervised fine-tuning run (spec_version 1).

    ``max_steps > 0`` overrides ``num_train_epochs`` (as in transformers' TrainingArguments).
    ``chat_template`` is either the name of a built-in default template or a Jinja string; None
    means the model's own template. Raises pydantic.ValidationError naming the field on bad input.
    """

    dataset_format: str | None = Field(default=None, description="override format detection")
    column_mapping: dict[str, str] | None = Field(
        default=None, description="the dataset's columns read as alpaca fields ({instruction, "
        "input, output, system: column}); set from the dataset's mapping when the run is created")
    max_seq_length: int = Field(default=1024, ge=8, le=1_048_576)
    num_train_epochs: float = Field(default=1.0, gt=0.0, le=1000.0)
    train_on_responses_only: bool = True
    packing: bool = False
    padding_free: bool = Field(
        default=True, description="put each micro-batch's rows into one sequence with no "
        "padding (TRL's padding_free; attention stays inside each row): the same rows per step "
        "as padded batches and no compute spent on pad tokens (on by default: 3.1x the real "
        "tokens/s of padded batches on real rows, bench/RESULTS.md). packing implies it")
    add_template_tokens: bool = Field(
        default=False, description="add the chat template's special tokens the model's "
        "tokenizer lacks (e.g. <|im_start|>/<|im_end|> on a base model) as single tokens: the "
        "embedding grows by their rows, trained beside LoRA (PEFT trainable_token_indices), "
        "and the adapter and every export carry the new vocabulary, so generation stops at "
        "the end-of-turn token (LLaMA-Factory's resize_vocab + new_special_tokens)")
    # held-out evaluation (HeldOutFields): transformers' names (eval_steps,
    # load_best_model_at_end, early stopping patience); cross-field rules in app.studio.evaluation
    eval_steps: int | None = Field(default=None, ge=1, description="evaluate the held-out "
                                   "loss every this many steps (default: save_steps)")
    per_device_eval_batch_size: int | None = Field(default=None, ge=1, le=4096)
    load_best_model_at_end: bool = Field(
        default=False, description="the adapter is the checkpoint with the lowest eval_loss "
        "(metric_for_best_model)")
    early_stopping_patience: int | None = Field(
        default=None, ge=1, le=10_000, description="stop after this many evaluations without "
        "a lower eval_loss")
    early_stopping_threshold: float = Field(default=0.0, ge=0.0, le=1e6)
    generation_eval_samples: int = Field(
        default=0, ge=0, le=100, description="at the end, greedy answers of the base and the "
        "fine-tuned model on up to this many held-out prompts, beside the reference")

    @model_validator(mode="after")
    def _steps(self) -> "TrainSpec":
        if self.max_steps == 0:
            raise ValueError("max_steps must be -1 (use num_train_epochs) or a positive number")
        return self


class ExportSpec(NumbersNotBooleans):
    """Export a run's result (spec_version 1): adapter, merged 16-bit, GGUF or Ollama."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    spec_version: Literal[1] = 1
    run_id: str
    format: Literal["adapter", "merged_16bit", "gguf", "ollama"]
    quantization: list[str] = Field(default_factory=list)
    checkpoint_step: int | None = Field(
        default=None, ge=1, description="export the adapter of this trainer checkpoint "
        "(checkpoints/checkpoint-<step>) instead of the final one: a cancelled or failed run")

    @field_validator("quantization")
    @classmethod
    def _quant(cls, v: list[str]) -> list[str]:
        out = [q.strip().upper() for q in v if q and q.strip()]
        for q in out:
            if q not in GGUF_TYPES:
                raise ValueError(f"unknown GGUF type {q!r}; use one of {', '.join(GGUF_TYPES)}")
        return list(dict.fromkeys(out))
    dtype: Literal["bf16", "fp16", "fp32"] | None = Field(
        default=None,
        description="merged_16bit weights; None: the base's own when bf16/fp16, else bf16")


class ImportModelSpec(BaseModel):
    """Make a registered model ready: download from the Hub, copy a folder, or convert llama2.c."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    spec_version: Literal[1] = 1
    model_id: str


# ---- GRPO -------------------------------------------------------------------------------
#: Built-in reward names (worker/rewards/builtin.py) plus ``custom`` (Python from the browser).
REWARD_NAMES = ("numeric_match", "exact_match", "regex_match", "format", "length_penalty",
                "text_similarity", "custom")
#: One line per reward, for the run form and the API docs.
REWARD_DESCRIPTIONS = {
    "numeric_match": "1 when the completion's final number (\\boxed{}, #### n, <answer>, else the "
                     "last number) equals the reference column's (GSM8K '#### n'), else 0",
    "exact_match": "1 when the completion equals the column (whitespace/case-insensitive; "
                   "params contains / negate / case_sensitive), else 0",
    "regex_match": "1 when params.pattern matches (and its first group equals params.column, "
                   "if given), else 0",
    "format": "1 for <think>…</think><answer>…</answer> and nothing else, 0.5 if the tags appear "
              "in order, else 0",
    "length_penalty": "−(completion tokens beyond params.target_tokens) / target_tokens, floor −1",
    "text_similarity": "fuzzy-match ratio of the completion to the column in [0, 1] (or 1/0 at "
                       "params.pass_threshold)",
    "custom": "your Python: def reward(prompt: str, completion: str, item: dict) -> float, run "
              "in a sandbox process (time and memory limits)",
}
CUSTOM_REWARD_SIGNATURE = "def reward(prompt: str, completion: str, item: dict) -> float"
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
#: The prompt column is the first of these a row has, unless the spec names one.
PROMPT_COLUMNS = ("prompt", "question", "instruction", "query", "problem", "input", "text")
#: The reference column is the first of these a row has, unless the spec names one.
ANSWER_COLUMNS = ("answer", "solution", "reference", "target", "output", "completion")


class RewardSpec(NumbersNotBooleans):
    """One reward function of a GRPO run: a built-in ``name`` (or ``custom``), its weight and params.

    ``params`` per reward (all optional unless stated):

    * numeric_match: ``column`` (default: the run's answer column), ``strict`` (only ``\\boxed{}``,
      ``#### n`` or ``<answer>`` count; otherwise the last number of the completion does too).
    * exact_match: ``column``, ``case_sensitive`` (False), ``strip`` (True), ``contains``
      (the column's value anywhere in the completion), ``negate``.
    * regex_match: ``pattern`` (required); with ``column`` the first group (or the whole match)
      must equal that column's value, without it any match scores.
    * format: ``reasoning_tag`` ("think"), ``answer_tag`` ("answer").
    * length_penalty: ``target_tokens`` (required): −(tokens beyond target)/target, floor −1.
    * text_similarity: ``column``, ``pass_threshold`` (fuzzy-match ratio in [0, 1] otherwise).
    * custom: ``source`` (required, Python defining ``entry``), ``entry`` ("reward"). Its time,
      memory and process limits are the admin's (``reward_*`` settings); a ``timeout_s`` or
      ``memory_mb`` that older specs carried is dropped.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    weight: float = 1.0
    label: str | None = Field(default=None, max_length=64, description="shown in charts")
    params: dict = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v not in REWARD_NAMES:
            raise ValueError(f"unknown reward {v!r}; choose one of {', '.join(REWARD_NAMES)}")
        return v

    @field_validator("weight")
    @classmethod
    def _weight(cls, v: float) -> float:
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("weight must be a finite number")
        return v

    @model_validator(mode="after")
    def _params(self) -> "RewardSpec":
        import regex

        p = self.params
        if self.name == "regex_match":
            pat = p.get("pattern")
            if not isinstance(pat, str) or not pat:
                raise ValueError("regex_match needs params.pattern (a Python regular expression)")
            try:  # the engine the reward matches with (worker/rewards/builtin.py)
                regex.compile(pat)
            except regex.error as e:
                raise ValueError(f"regex_match pattern does not compile: {e}") from None
        if self.name == "length_penalty":
            t = p.get("target_tokens")
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise ValueError("length_penalty needs params.target_tokens, a positive integer")
        if self.name == "custom":
            src = p.get("source")
            if not isinstance(src, str) or not src.strip():
                raise ValueError("a custom reward needs params.source (Python code)")
            try:
                compile(src, "<custom reward>", "exec")
            except SyntaxError as e:
                raise ValueError(f"custom reward source: line {e.lineno}: {e.msg}") from None
            for key in ("timeout_s", "memory_mb"):  # limits are the admin's now
                p.pop(key, None)
        return self

    @property
    def display_name(self) -> str:
        return self.label or self.name


class GrpoSpec(HeldOutFields, LoraTrainingFields):
    """A LoRA/QLoRA GRPO run (spec_version 1), with TRL's GRPOConfig names.

    ``per_device_train_batch_size`` counts completions, as in TRL: each optimizer step sees
    ``per_device_train_batch_size * gradient_accumulation_steps`` completions, which must be a
    multiple of ``num_generations`` (whole groups). ``max_prompt_length`` keeps the last tokens of
    a longer prompt. ``chat_template`` "none" sends the prompt text as is (base models).
    """

    prompt_column: str | None = None
    answer_column: str | None = None
    rewards: list[RewardSpec] = Field(min_length=1)
    num_generations: int = Field(default=4, ge=2, le=256)
    max_prompt_length: int = Field(default=256, ge=1, le=1_048_576)
    max_completion_length: int = Field(default=256, ge=1, le=1_048_576)
    temperature: float = Field(default=1.0, gt=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    beta: float = Field(default=0.04, ge=0.0, le=100.0)
    epsilon: float = Field(default=0.2, gt=0.0, le=10.0)
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    num_iterations: int = Field(default=1, ge=1, le=64)
    sample_every: int = Field(default=1, ge=1, description="steps between sample-table events")
    reward_eval_samples: int = Field(
        default=16, ge=0, le=200, description="with a held-out set: the run's rewards applied "
        "to greedy completions of up to this many held-out prompts by the base model (before "
        "training) and the fine-tuned one (after)")
    # GRPO's own optimizer defaults (a small learning rate, fixed steps, whole groups per step)
    learning_rate: float = Field(default=5e-6, ge=MIN_LEARNING_RATE, le=1.0)
    per_device_train_batch_size: int = Field(default=4, ge=1, le=4096)
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=4096)
    max_steps: int = Field(default=200, ge=1, le=10_000_000)
    n_epochs: float | None = Field(
        default=None, gt=0,
        description="informational: max_steps was resolved from this many passes over the "
                    "prompts (OpenAI hyperparameters.n_epochs); training runs max_steps")
    warmup_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    lr_scheduler_type: str = "constant"
    grader: dict[str, Any] | None = Field(
        default=None, description="informational: the OpenAI grader the rewards were mapped "
                                  "from (echoed as method.reinforcement.grader)")

    _loss = one_of("loss_type", GRPO_LOSS_TYPES)
    _scale = one_of("scale_rewards", SCALE_REWARDS)

    @model_validator(mode="after")
    def _groups(self) -> "GrpoSpec":
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if per_step % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size × gradient_accumulation_steps ({per_step}) must be a "
                f"multiple of num_generations ({self.num_generations}) so that every step scores "
                f"whole groups")
        return self

    @property
    def has_custom_rewards(self) -> bool:
        return any(r.name == "custom" for r in self.rewards)
