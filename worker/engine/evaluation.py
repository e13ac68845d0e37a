"""Held-out evaluation for SFT runs: the split, the trainer's eval arguments and callbacks, and
the generation eval at the end.

* :func:`split_held_out` takes ``validation_split_percentage`` of the encoded rows out of the
  training set, shuffled with the run's seed (the same rows every time for the same seed).
* :func:`eval_arguments` are the transformers TrainingArguments of an evaluating run
  (``eval_strategy="steps"``, ``eval_steps``, ``metric_for_best_model="eval_loss"``,
  ``load_best_model_at_end``, ``eval_on_start`` on a fresh start: the base model's eval loss).
* :func:`eval_callbacks`: metric events with ``step`` and ``eval_loss`` after every evaluation,
  one with ``best_step`` / ``best_eval_loss`` / ``best_checkpoint`` when training ends, and
  transformers' ``EarlyStoppingCallback`` when the spec has ``early_stopping_patience``.
* :func:`generation_eval`: greedy answers of the base (adapter disabled) and the fine-tuned
  model on held-out prompts beside the reference, with exact match and token-overlap F1.

A held-out row's prompt is its tokens before the first trained token and its reference the
first run of trained tokens (the first assistant answer), so the generation eval sees exactly
what training scored.
"""
from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

#: End-of-turn texts the reference and the answers are cut at (the built-in templates' and the
#: common model templates' markers).
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
               "</s>", "<|end_of_text|>")
#: Characters kept of a prompt (its end) and of an answer (its start) in the stored table.
PROMPT_CHARS, ANSWER_CHARS = 600, 1000


def held_out_count(rows: int, percentage: float) -> int:
    """How many of ``rows`` encoded rows ``percentage`` percent holds out (at least one)."""
    return max(1, round(rows * percentage / 100.0))


def split_held_out(rows: int, percentage: float, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices), both ascending: ``percentage`` percent of
    ``rows`` chosen by a shuffle seeded with ``seed``. Raises ValueError when nothing would
    be left to train on."""
    k = held_out_count(rows, percentage)
    if k >= rows:
        raise ValueError(f"holding out {percentage:g}% of {rows} trainable row"
                         f"{'s' if rows != 1 else ''} leaves none to train on")
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    return sorted(order[k:]), sorted(order[:k])


def eval_arguments(spec, resuming: bool) -> dict[str, Any]:
    """TrainingArguments overrides of a run with a held-out set (empty without one)."""
    if not spec.has_held_out:
        return {}
    return dict(eval_strategy="steps", eval_steps=spec.eval_steps or spec.save_steps,
                per_device_eval_batch_size=(spec.per_device_eval_batch_size
                                            or spec.per_device_train_batch_size),
                metric_for_best_model="eval_loss", greater_is_better=False,
                load_best_model_at_end=spec.load_best_model_at_end,
                prediction_loss_only=True, eval_on_start=not resuming)


def eval_callbacks(spec, metric: Callable[..., None]) -> tuple[Any, list]:
    """(the reporter, every callback to add): the reporter sends a metric event per evaluation
    (``step``, ``total_steps``, ``eval_loss`` and the other ``eval_*`` numbers) and, when
    training ends, one with the best evaluation (``best_step``, ``best_eval_loss``,
    ``best_checkpoint``, ``early_stopped``); its :meth:`summary` is the result's ``eval``."""
    from transformers import EarlyStoppingCallback, TrainerCallback

    stopper = None
    if spec.early_stopping_patience:
        stopper = EarlyStoppingCallback(spec.early_stopping_patience,
                                        spec.early_stopping_threshold)

    class EvalReporter(TrainerCallback):
        def __init__(self):
            self.points: list[tuple[int, float]] = []
            self.best: dict[str, Any] = {}
            self.early_stopped = False

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if not isinstance(logs.get("eval_loss"), (int, float)):
                return
            extra = {k: v for k, v in logs.items() if k.startswith("eval_")
                     and isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.points.append((state.global_step, float(logs["eval_loss"])))
            metric(step=state.global_step, total_steps=state.max_steps,
                   epoch=logs.get("epoch"), **extra)

        def on_train_end(self, args, state, control, **kw):
            self.early_stopped = bool(stopper and stopper.early_stopping_patience_counter
                                      >= stopper.early_stopping_patience)
            if state.best_global_step:
                self.best = {"best_step": int(state.best_global_step),
                             "best_eval_loss": state.best_metric,
                             "best_checkpoint": f"checkpoint-{state.best_global_step}"}
            if self.best or self.early_stopped:
                metric(step=state.global_step, total_steps=state.max_steps,
                       early_stopped=self.early_stopped, **self.best)

        def summary(self, earlier: dict[int, float] | None = None) -> dict[str, Any]:
            """What the run's result records of its evaluations; ``earlier``: ``{step:
            eval_loss}`` of a resumed run's earlier attempts up to its checkpoint, so the counts
            and the first loss are the whole run's (this attempt's value wins a shared step)."""
            points = sorted({**(earlier or {}), **dict(self.points)}.items())
            return {"eval_steps": spec.eval_steps or spec.save_steps,
                    "evaluations": len(points),
                    "first_eval_loss": points[0][1] if points else None,
                    "last_eval_loss": points[-1][1] if points else None,
                    **self.best, "load_best_model_at_end": spec.load_best_model_at_end,
                    "early_stopping_patience": spec.early_stopping_patience,
                    "early_stopped": self.early_stopped}

    reporter = EvalReporter()
    return reporter, [reporter] + ([stopper] if stopper else [])


# ---- generation eval --------------------------------------------------------------------------
def cut_at_end(text: str) -> str:
    """``text`` up to its first end-of-turn marker (:data:`END_MARKERS`), stripped."""
    for m in END_MARKERS:
        i = text.find(m)
        if i >= 0:
            text = text[:i]
    return text.strip()


def normalized(text: str) -> str:
    """Whitespace collapsed and stripped (exact match compares these)."""
    return " ".join(text.split())


def token_f1(answer: str, reference: str) -> float:
    """Token-overlap F1 (SQuAD style) of lower-cased word tokens; 1.0 when both are empty."""
    a, r = re.findall(r"\w+", answer.lower()), re.findall(r"\w+", reference.lower())
    if not a or not r:
        return float(a == r)
    common: dict[str, int] = {}
    for t in a:
        common[t] = common.get(t, 0) + 1
    same = 0
    for t in r:
        if common.get(t, 0) > 0:
            common[t] -= 1
            same += 1
    if not same:
        return 0.0
    p, rec = same / len(a), same / len(r)
    return round(2 * p * rec / (p + rec), 4)


def prompt_and_reference(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt ids: the tokens before the first trained one, reference ids: the first run of
    trained tokens); ([], []) when no token is trained."""
    first = next((i for i, x in enumerate(labels) if x != -100), None)
    if first is None:
        return [], []
    end = first
    while end < len(labels) and labels[end] != -100:
        end += 1
    return list(input_ids[:first]), list(input_ids[first:end])


def _clip(text: str, limit: int, from_end: bool = False) -> str:
    if len(text) <= limit:
        return text
    return "…" + text[-limit + 1:] if from_end else text[:limit - 1] + "…"


def generation_eval(model, tokenizer, dataset, row_numbers: list[int], n: int,
                    max_new_tokens: int, check: Callable[[], None] | None = None,
                    on_log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Greedy answers of the base model (adapters disabled) and the fine-tuned one on the first
    ``n`` rows of the held-out ``dataset`` (``input_ids`` + ``labels``; ``row_numbers`` their
    rows in the file), each cut at its end of turn, beside the reference.

    Returns ``{"rows": [{row, prompt, reference, base, fine_tuned, base_exact_match,
    fine_tuned_exact_match, base_token_f1, fine_tuned_token_f1}], "summary": {samples,
    base_exact_match, fine_tuned_exact_match, base_token_f1, fine_tuned_token_f1}}`` (means;
    the base entries are None when the model cannot disable its adapter)."""
    import torch

    from worker.engine.decode import fast_generate

    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    can_disable = hasattr(model, "disable_adapter")
    was_training = model.training
    model.eval()

    def greedy(ids: list[int], budget: int) -> str:
        x = torch.tensor([ids], device=device)
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=budget, eos_token_id=eos, pad_token_id=pad,
                             use_cache=True)
        return cut_at_end(tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True))

    rows = []
    try:
        with fast_generate(model, on_log=on_log, check=check):
            for i in range(min(n, len(dataset))):
                if check:
                    check()
                item = dataset[i]
                prompt, ref = prompt_and_reference(item["input_ids"], item["labels"])
                if not prompt or not ref:
                    continue
                budget = max(1, min(max_new_tokens, len(ref) + 16))
                reference = cut_at_end(tokenizer.decode(ref, skip_special_tokens=True))
                tuned = greedy(prompt, budget)
                base = None
                if can_disable:
                    with model.disable_adapter():
                        base = greedy(prompt, budget)
                row = {"row": row_numbers[i] if i < len(row_numbers) else None,
                       "prompt": _clip(tokenizer.decode(prompt, skip_special_tokens=True),
                                       PROMPT_CHARS, from_end=True),
                       "reference": _clip(reference, ANSWER_CHARS),
                       "fine_tuned": _clip(tuned, ANSWER_CHARS),
                       "fine_tuned_exact_match": normalized(tuned) == normalized(reference),
                       "fine_tuned_token_f1": token_f1(tuned, reference),
                       "base": None if base is None else _clip(base, ANSWER_CHARS),
                       "base_exact_match": None if base is None
                       else normalized(base) == normalized(reference),
                       "base_token_f1": None if base is None else token_f1(base, reference)}
                rows.append(row)
    finally:
        if was_training:
            model.train()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in rows if r[key] is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {"rows": rows, "summary": {
        "samples": len(rows), "base_exact_match": mean("base_exact_match"),
        "fine_tuned_exact_match": mean("fine_tuned_exact_match"),
        "base_token_f1": mean("base_token_f1"), "fine_tuned_token_f1": mean("fine_tuned_token_f1")}}
