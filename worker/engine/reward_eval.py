"""The GRPO before/after reward eval: the run's own reward functions applied to greedy
completions of held-out prompts by the base model and by the fine-tuned one.

"Before" is the base model with the adapter disabled, which is the model before training (a LoRA
adapter starts with ``B = 0``, so it changes nothing until trained); "after" is the adapter the
run (or a checkpoint of it) trained. Both are computed when the model is loaded once, so a
resumed run, or an on-demand eval of a checkpoint, compares against the same base.

A prompt is the rendered text training sampled from (:func:`worker.engine.grpo.build_prompts`),
tokenised without extra special tokens and cut to its last ``max_prompt_length`` tokens, as
:class:`~worker.engine.grpo` does; a completion is decoded as TRL decodes one
(``skip_special_tokens``, up to and including the first end-of-sequence token, which its token
count includes), so a reward sees what it saw in training. One prompt at a time (no padding):
the same tokens a plain ``model.generate`` of that prompt gives.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from worker.engine.grpo import COL, clip_end, clip_start
from worker.rewards.base import Batch, RewardFunction, validate

#: Characters kept of a prompt (its end), a reference and a completion in the stored table
#: (the rewards score the whole completion).
PROMPT_CHARS, REFERENCE_CHARS, COMPLETION_CHARS = 600, 1000, 4000
#: Built-in rewards that score correctness 1 or 0: their mean is an accuracy (GSM8K's
#: ``numeric_match`` in the worked example).
CORRECTNESS_REWARDS = ("numeric_match", "exact_match")


def greedy_completion(model, tokenizer, prompt: str, max_prompt_length: int,
                      max_new_tokens: int) -> tuple[str, int]:
    """(completion text, completion tokens) of ``model``'s greedy answer to ``prompt``."""
    import torch

    ids = tokenizer(text=prompt, add_special_tokens=False)["input_ids"][-max_prompt_length:]
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    x = torch.tensor([ids], device=device)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                         use_cache=True)
    new = out[0, len(ids):].tolist()
    if eos is not None and eos in new:
        new = new[:new.index(eos) + 1]
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def score(functions: Sequence[RewardFunction], prompts: list[str], completions: list[str],
          tokens: list[int], columns: dict[str, list[Any]]) -> dict[str, list[float]]:
    """Each reward function's validated rewards of the completions (``{name: [reward]}``).
    Raises :class:`worker.rewards.base.RewardError` as training would."""
    batch = Batch(list(prompts), list(completions), list(tokens), columns)
    return {f.name: validate(f.name, f.score(batch), batch) for f in functions}


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def reward_eval(model, tokenizer, held, row_numbers: list[int], functions: Sequence[RewardFunction],
                kinds: dict[str, str], n: int, max_prompt_length: int, max_new_tokens: int,
                answer_column: str | None = None, check: Callable[[], None] | None = None,
                on_log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Greedy completions of the first ``n`` prompts of ``held`` (a datasets.Dataset with
    ``prompt`` and ``col__<column>``; ``row_numbers`` their rows in the file) by the base
    (``model.disable_adapter()``) and the fine-tuned ``model``, scored by ``functions``
    (``kinds``: function name -> built-in reward name, for the accuracy).

    Returns ``{"rows": [{row, prompt, reference, base, fine_tuned, base_tokens,
    fine_tuned_tokens, base_rewards: {name: float}, fine_tuned_rewards, base_reward,
    fine_tuned_reward}], "summary": {samples, functions: [{name, weight, base, fine_tuned}],
    base_reward, fine_tuned_reward, accuracy: [{function, base, fine_tuned}]}}`` (means; a
    ``*_reward`` is the weighted sum, as in training). Raises RewardError."""
    import torch

    from worker.engine.decode import fast_generate

    k = min(n, len(held))
    items = [held[i] for i in range(k)]
    prompts = [it["prompt"] for it in items]
    columns = {c[len(COL):]: [it[c] for it in items] for c in held.column_names
               if c.startswith(COL)}
    was_training = model.training
    model.eval()
    out: dict[str, list] = {"base": [], "fine_tuned": []}
    try:
        with torch.no_grad(), fast_generate(model, on_log=on_log, check=check):
            for p in prompts:
                if check:
                    check()
                out["fine_tuned"].append(greedy_completion(model, tokenizer, p,
                                                           max_prompt_length, max_new_tokens))
                with model.disable_adapter():
                    out["base"].append(greedy_completion(model, tokenizer, p,
                                                         max_prompt_length, max_new_tokens))
    finally:
        if was_training:
            model.train()
    scores = {which: score(functions, prompts, [c for c, _ in got], [t for _, t in got], columns)
              for which, got in out.items()}
    weights = {f.name: f.weight for f in functions}

    def total(which: str, i: int) -> float:
        return sum(weights[name] * vals[i] for name, vals in scores[which].items())

    rows = []
    for i, p in enumerate(prompts):
        ref = columns.get(answer_column, [None] * k)[i] if answer_column else None
        row = {"row": row_numbers[i] if i < len(row_numbers) else None,
               "prompt": clip_start(p, PROMPT_CHARS),
               "reference": None if ref is None else clip_end(str(ref), REFERENCE_CHARS)}
        for which in ("base", "fine_tuned"):
            text, tokens = out[which][i]
            row[which] = clip_end(text, COMPLETION_CHARS)
            row[f"{which}_tokens"] = tokens
            row[f"{which}_rewards"] = {name: vals[i] for name, vals in scores[which].items()}
            row[f"{which}_reward"] = round(total(which, i), 6)
        rows.append(row)
    accuracy = [{"function": f.name,
                 **{w: _mean([float(v >= 1.0) for v in scores[w][f.name]])
                    for w in ("base", "fine_tuned")}}
                for f in functions if kinds.get(f.name) in CORRECTNESS_REWARDS]
    return {"rows": rows, "summary": {
        "samples": len(rows),
        "functions": [{"name": f.name, "weight": f.weight,
                       "base": _mean(scores["base"][f.name]),
                       "fine_tuned": _mean(scores["fine_tuned"][f.name])} for f in functions],
        "base_reward": _mean([r["base_reward"] for r in rows]),
        "fine_tuned_reward": _mean([r["fine_tuned_reward"] for r in rows]),
        "accuracy": accuracy}}
