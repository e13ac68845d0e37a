"""GRPO with TRL's GRPOTrainer on our PEFT-wrapped model.

* **Reference policy**: with a PeftModel and ``beta > 0`` TRL keeps no second model; it computes
  the reference log-probabilities with the adapter disabled (``use_adapter(model, None)``), i.e.
  the frozen base. Asserted in tests/grpo (``trainer.ref_model is None``).
* **Prompts** arrive as rendered text (our chat template, see :func:`build_prompts`); they are
  tokenised without extra special tokens (the template writes BOS where it wants it) and
  left-truncated to ``max_prompt_length`` (TRL 1.15 has no such argument any more).
* **Rewards** are ours (:mod:`worker.rewards`): each is a TRL reward function that validates its
  output and records it; after TRL scores a generation batch we replace its advantages with
  :func:`worker.rewards.base.group_advantages` computed from the same validated rewards, so a
  group of equal rewards contributes exactly zero (TRL divides by ``std + 1e-4``) and nothing can
  be NaN. Per-function means, std, the zero-variance fraction and a few samples are kept for
  the metric/sample events.
* **Log-probabilities** (policy, old policy and the adapter-disabled reference) are computed
  chunked from the final hidden states, never as a full ``[tokens, vocab]`` logits tensor, by
  :func:`worker.engine.logps.policy_logps`: with the kernel engine patched on the model the
  hidden states come from the engine's fused decoder layers (TRL's own fused head would call the
  HF backbone and bypass them), then :func:`~worker.engine.logps.chunked_logps_entropy` (each
  chunk's logits recomputed in backward). Without the engine: TRL's fused Triton LM head on
  CUDA, the same PyTorch chunked head on the HF backbone elsewhere.
* Generation is TRL's non-vLLM path (``model.generate``), which :func:`worker.engine.decode.
  fast_generate` routes to the engine's own decoder (static KV cache, fused layers, NF4 matmul
  without a dense copy) for Llama-like models and plain sampling options, else to HF's generate;
  inside :func:`worker.engine.gencache.dense_generation`: NF4 bases are dequantised once for the
  phase (within the VRAM budget) instead of once per generated token, and freed before training.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.data.loader import iter_records
from worker import gpu
from worker.engine.logps import chunked_logps_entropy  # noqa: F401  (re-exported)
from worker.rewards.base import Batch, RewardFunction, group_advantages, validate

#: Dataset columns are passed to TRL under this prefix so that no user column can collide with
#: TRL's own reward-function keyword arguments (``prompts``, ``completions``, ``trainer_state``).
COL = "col__"
#: Rows of the sample table streamed per logged step.
SAMPLE_ROWS = 8


# ---- prompts ------------------------------------------------------------------------------
@dataclass
class PromptSet:
    dataset: object  # datasets.Dataset: prompt + col__<name> columns
    rows: int
    skipped: int
    prompt_column: str
    answer_column: str | None
    columns: list[str]
    examples: list[str] = field(default_factory=list)
    row_numbers: list[int] = field(default_factory=list)  # each prompt's 1-based file row


def _scalar(v: Any) -> Any:
    return v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v)


def build_prompts(path: str, bundle, template: str | None, prompt_column: str | None,
                  answer_column: str | None, system_prompt: str | None,
                  check: Callable[[], None] | None = None) -> PromptSet:
    """Read the prompt dataset and render each prompt for generation.

    Columns and prompt messages come from :mod:`app.data.prompts` (a text column such as
    GSM8K's ``question``, or OpenAI-style ``messages``). ``template`` None means "no template":
    the prompt text (the last user turn) is used as is, after the BOS token; otherwise the
    messages are rendered with ``add_generation_prompt=True``. Rows without a prompt are skipped
    (counted): an empty cell, or messages the upload report lists as invalid (one that does not
    end on a user turn, :func:`app.data.prompts.message_problem`). Raises DatasetError.
    """
    from datasets import Dataset

    from app.data.chat_template import render_chat
    from app.data.errors import DatasetError
    from app.data.prompts import pick_columns, prompt_messages

    rows, numbers = [], []
    skipped = 0
    for rec in iter_records(path):
        if rec.data is None:
            skipped += 1
            continue
        rows.append(rec.data)
        numbers.append(rec.row)
        if check and len(rows) % 256 == 0:
            check()
    if not rows:
        raise DatasetError("the dataset has no readable rows")
    pcol, acol = pick_columns(rows[0], prompt_column, answer_column)
    columns = sorted({k for r in rows for k in r})
    prompts, cols, kept = [], {c: [] for c in columns}, []
    bos = bundle.bos_token or ""
    for number, r in zip(numbers, rows):
        msgs = prompt_messages(r.get(pcol), pcol, system_prompt)
        if msgs is None:
            skipped += 1
            continue
        kept.append(number)
        if template is None:
            rendered = bos + msgs[-1]["content"]
        else:
            rendered = render_chat(msgs, template, bos_token=bos, eos_token=bundle.eos_token or "",
                                   add_generation_prompt=True, special_tokens=bundle.special_tokens)
        prompts.append(rendered)
        for c in columns:
            cols[c].append(_scalar(r.get(c)))
    if not prompts:
        raise DatasetError(f"no row has a non-empty {pcol!r}")
    ds = Dataset.from_dict({"prompt": prompts, **{COL + c: v for c, v in cols.items()}})
    return PromptSet(ds, len(prompts), skipped, pcol, acol, columns, prompts[:2], kept)


# ---- rewards as TRL reward functions ------------------------------------------------------
class Scorer:
    """Adapts our reward functions to TRL's reward-function protocol and keeps their results."""

    def __init__(self, functions: list[RewardFunction], num_generations: int, scale: str):
        self.functions = functions
        self.num_generations = num_generations
        self.scale = scale
        self.current: dict[str, list[float]] = {}
        self.batch: Batch | None = None

    def trl_functions(self) -> list[Callable]:
        return [self._adapter(f) for f in self.functions]

    def _adapter(self, f: RewardFunction) -> Callable:
        def reward(prompts, completions, completion_ids=None, **kwargs):
            batch = Batch(list(prompts), [str(c) for c in completions],
                          [len(c) for c in (completion_ids or [[]] * len(completions))],
                          {k[len(COL):]: list(v) for k, v in kwargs.items() if k.startswith(COL)})
            values = validate(f.name, f.score(batch), batch)
            self.batch = batch
            self.current[f.name] = values
            return values

        reward.__name__ = f.name
        return reward

    def advantages(self, accelerator=None) -> tuple[list[float], list[float], int]:
        """(weighted totals, advantages, zero-variance groups) of the last scored batch.

        On several ranks (``accelerator.num_processes`` > 1) a group's completions may be
        generated on different ranks: the totals of every rank are gathered (in rank order, as
        TRL slices its batch), the advantages computed over whole groups, and this rank's slice
        of them returned; totals and the zero-variance count are those of the whole batch. The
        reward functions' own values (``current``, ``batch``) stay this rank's."""
        per = [self.current[f.name] for f in self.functions]
        n = len(per[0])
        total = [sum(f.weight * per[k][i] for k, f in enumerate(self.functions)) for i in range(n)]
        if accelerator is None or accelerator.num_processes <= 1:
            adv, zero = group_advantages(total, self.num_generations, self.scale)
            return total, adv, zero
        from accelerate.utils import gather_object

        everyone = list(gather_object(total))
        adv, zero = group_advantages(everyone, self.num_generations, self.scale)
        start = accelerator.process_index * n
        return everyone, adv[start:start + n], zero

    def close(self) -> None:
        for f in self.functions:
            f.close()


# ---- the trainer --------------------------------------------------------------------------
def make_trainer(model, tokenizer, train_dataset, args, scorer: Scorer, max_prompt_length: int,
                 callbacks=(), on_log: Callable[[str], None] | None = None,
                 check: Callable[[], None] | None = None):
    """A GRPOTrainer subclass wired to our rewards, advantages, prompt handling and the engine.

    ``on_log`` is told once what the first generation phase held dense (NF4 cache, see
    :mod:`worker.engine.gencache`) and which generator ran it (``generation: ...``, see
    :func:`worker.engine.decode.fast_generate`). ``check()`` is called while completions are
    generated and raises to abandon the step (cancel, lease lost, shutdown: the job's
    ``JobContext.check``), so a stop does not wait for a long rollout."""
    import torch
    from trl import GRPOTrainer

    from worker.engine.engine import engine_state
    from worker.engine.decode import fast_generate
    from worker.engine.gencache import dense_generation, generation_reserve
    from worker.engine.logps import policy_logps

    told = [on_log] if on_log else []

    class WhetstoneGRPOTrainer(GRPOTrainer):
        stats: list[dict[str, Any]]
        samples: list[dict[str, Any]]

        def _tokenize_prompts(self, prompts):
            ids = self.processing_class(text=list(prompts), add_special_tokens=False)["input_ids"]
            return [x[-max_prompt_length:] for x in ids], None, {}

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                               logits_to_keep, batch_size=None,
                                               compute_entropy=False, compute_aux_loss=False,
                                               _force_chunked=False, **kw):
            engine_on = engine_state(self.accelerator.unwrap_model(model)) is not None
            trl_fused = input_ids.device.type == "cuda" and not _force_chunked and not engine_on
            if trl_fused or any(v is not None for v in kw.values()):
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kw)
            lp, ent = policy_logps(self.accelerator.unwrap_model(model), input_ids,
                                   attention_mask, logits_to_keep, self.temperature, batch_size,
                                   compute_entropy, self.accelerator.autocast)
            return lp, ent, None

        def _generate(self, prompts):
            lm = self.accelerator.unwrap_model(self.model)
            st = engine_state(lm)
            say = told.pop() if told else None
            if st is None:
                with fast_generate(lm, on_log=say, check=check):
                    return super()._generate(prompts)
            cfg = lm.config.get_text_config()
            dtype_bytes = torch.finfo(lm.get_input_embeddings().weight.dtype).bits // 8
            reserve = generation_reserve(cfg, len(prompts),
                                         max_prompt_length + self.max_completion_length,
                                         dtype_bytes)
            with dense_generation(lm, st.vram_budget_gib, reserve=reserve, on_log=say), \
                    fast_generate(lm, on_log=say, check=check):
                return super()._generate(prompts)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            total, adv, zero = scorer.advantages(self.accelerator)
            out["advantages"] = torch.tensor(adv, dtype=out["advantages"].dtype,
                                             device=out["advantages"].device)
            groups = len(total) // scorer.num_generations
            mean = sum(total) / len(total)
            std = (sum((t - mean) ** 2 for t in total) / max(1, len(total) - 1)) ** 0.5
            stat = {"reward": mean, "reward_std": std, "frac_zero_std_groups": zero / groups,
                    "zero_std_groups": zero, "groups": groups}
            for f in scorer.functions:
                vals = scorer.current[f.name]
                if self.accelerator.num_processes > 1:  # every rank's completions
                    from accelerate.utils import gather_object

                    vals = list(gather_object(vals))
                stat[f"reward/{f.name}"] = sum(vals) / len(vals)
            self.stats.append(stat)
            b = scorer.batch
            self.samples = [
                {"prompt": clip_start(b.prompts[i], 300), "completion": clip_end(b.completions[i], 600),
                 "tokens": b.completion_tokens[i], "group": i // scorer.num_generations,
                 "rewards": {f.name: scorer.current[f.name][i] for f in scorer.functions},
                 "reward": total[i], "advantage": adv[i]}
                for i in range(min(SAMPLE_ROWS, len(b.prompts)))]  # this rank's (rank 0: first)
            return out

    trainer = WhetstoneGRPOTrainer(model=model, reward_funcs=scorer.trl_functions(), args=args,
                                   train_dataset=train_dataset, processing_class=tokenizer,
                                   callbacks=list(callbacks))
    trainer.stats, trainer.samples = [], []
    return trainer


def grpo_config(spec, output_dir: str, cuda: bool, optim: str, **overrides: Any):
    """TRL GRPOConfig from a GrpoSpec (TRL's own argument names)."""
    import torch
    from trl import GRPOConfig

    bf16 = bool(cuda and torch.cuda.is_bf16_supported())
    kw: dict[str, Any] = dict(
        output_dir=output_dir, num_generations=spec.num_generations,
        max_completion_length=spec.max_completion_length, temperature=spec.temperature,
        top_p=spec.top_p, beta=spec.beta, epsilon=spec.epsilon, loss_type=spec.loss_type,
        scale_rewards=spec.scale_rewards, num_iterations=spec.num_iterations,
        learning_rate=spec.learning_rate, per_device_train_batch_size=spec.per_device_train_batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps, max_steps=spec.max_steps,
        warmup_steps=min(spec.warmup_ratio, 0.999), lr_scheduler_type=spec.lr_scheduler_type,
        weight_decay=spec.weight_decay, max_grad_norm=spec.max_grad_norm, optim=optim,
        seed=spec.seed, data_seed=spec.seed, logging_steps=spec.logging_steps,
        save_strategy="steps", save_steps=spec.save_steps, save_total_limit=2,
        reward_weights=[r.weight for r in spec.rewards], report_to="none", disable_tqdm=True,
        use_cpu=not cuda, bf16=bf16, fp16=bool(cuda and not bf16),
        gradient_checkpointing=bool(cuda), dataloader_num_workers=0,
        dataloader_pin_memory=cuda, log_completions=False, remove_unused_columns=False,
    )
    from worker.engine.sft import ddp_arguments

    kw.update(ddp_arguments(spec.gradient_accumulation_steps, cuda))
    kw.update(overrides)
    return GRPOConfig(**kw)


ELLIPSIS = "…"


def clip_end(text: str, limit: int) -> str:
    """``text`` kept from its start to at most ``limit`` characters, cut at a word boundary
    (mid-word only when a single word is that long) and marked with a trailing "…"."""
    if len(text) <= limit:
        return text
    head = text[:limit - 1]
    cut = max(head.rfind(" "), head.rfind("\n"))
    return (head[:cut] if cut > limit // 2 else head).rstrip() + ELLIPSIS


def clip_start(text: str, limit: int) -> str:
    """``text``'s last ``limit`` characters at most (a prompt's end is what the model answers),
    cut at a word boundary and marked with a leading "…"."""
    if len(text) <= limit:
        return text
    tail = text[len(text) - limit + 1:]
    cut = min((i for i in (tail.find(" "), tail.find("\n")) if i >= 0), default=-1)
    return ELLIPSIS + (tail[cut + 1:] if 0 <= cut < limit // 2 else tail).lstrip()


def progress_callback(metric: Callable[..., None], sample: Callable[..., None],
                      stop_reason: Callable[[], str | None], trainer_ref: Callable[[], Any],
                      on_stop: Callable[[str], None] | None = None, sample_every: int = 1,
                      warn: Callable[[str], None] | None = None):
    """A TrainerCallback: GRPO metric events (rewards per function, std, KL, length, zero-variance
    fraction), sample-table events, ``warn`` when nothing is being learned
    (:class:`worker.engine.grpo_health.ZeroVarianceWatch`), and stops on cancel / lease loss /
    shutdown."""
    from worker.engine.callbacks import stopping_callback
    from worker.engine.grpo_health import ZeroVarianceWatch

    watch = ZeroVarianceWatch()

    class _Callback(stopping_callback()):
        def __init__(self):
            super().__init__(stop_reason, on_stop)
            self.rewards: list[tuple[int, float]] = []
            self.last: dict[str, float] = {}

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if "loss" not in logs:
                return
            trainer = trainer_ref()
            stats, trainer.stats = trainer.stats, []
            if stats:  # else (num_iterations > 1) this step reused the last generation batch
                self.last = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
            avg = self.last
            per_step, eta = self.step_timing(state)
            mem, kind = gpu.memory()
            data = dict(step=state.global_step, total_steps=state.max_steps,
                        loss=logs.get("loss"), learning_rate=logs.get("learning_rate"),
                        grad_norm=logs.get("grad_norm"), kl=logs.get("kl"),
                        entropy=logs.get("entropy"),
                        completion_length=logs.get("completions/mean_length"),
                        clipped_ratio=logs.get("completions/clipped_ratio"),
                        step_seconds=round(per_step, 3) if per_step else None,
                        eta_seconds=eta, memory_gib=round(mem, 4), memory_kind=kind,
                        peak_gib=round(gpu.peak_gib(), 4), **avg)
            if "reward" in avg:
                self.rewards.append((state.global_step, avg["reward"]))
            metric(**data)
            problem = watch.observe(state.global_step, avg.get("frac_zero_std_groups"),
                                    avg.get("groups"))
            if problem and warn is not None:
                warn(problem)
            if trainer.samples and state.global_step % sample_every == 0:
                sample(step=state.global_step, rows=trainer.samples)

    return _Callback()
