"""The ``grpo`` job's held-out prompts and its before/after reward eval
(:mod:`worker.engine.reward_eval`), also used by the on-demand ``evaluate`` job.

Held-out prompts: a ``validation_file`` (rendered like the training prompts) or
``validation_split_percentage`` of the prompts, chosen by the SFT rule
(:func:`worker.engine.evaluation.split_held_out`: a shuffle seeded with the run's seed), so the
same prompts every time. Result entries: ``eval`` (where the prompts came from, their count and
file rows) and ``reward_eval`` (rows + summary; also in ``eval.json``, artifact ``eval``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.store import repo
from worker.context import JobContext, JobError
from worker.jobs.evaluation import MAX_LISTED_ROWS, split


@dataclass
class HeldPrompts:
    """The prompts to train on, the held-out ones (None: no eval) and what to record."""

    train: Any  # datasets.Dataset (prompt + col__<column>)
    held: Any = None
    row_numbers: list[int] = field(default_factory=list)
    info: dict[str, Any] | None = None
    answer_column: str | None = None


def prepare(ctx: JobContext, spec, prompts, bundle, template: str | None) -> HeldPrompts:
    """Split ``prompts`` (:class:`worker.engine.grpo.PromptSet`) or read the validation file's
    prompts the same way; logs what was held out. Raises JobError (validation file gone or
    unreadable, nothing left to train on)."""
    from app.data.errors import DatasetError
    from worker.engine import grpo

    if not spec.has_held_out:
        return HeldPrompts(prompts.dataset, answer_column=prompts.answer_column)
    if spec.validation_file:
        try:
            vds = repo.get_dataset(ctx.engine, spec.validation_file)
        except repo.NotFound:
            raise JobError(f"validation_file {spec.validation_file} no longer exists") from None
        try:
            vp = grpo.build_prompts(vds.path, bundle, template, spec.prompt_column,
                                    spec.answer_column, spec.system_prompt, check=ctx.check)
        except (DatasetError, ValueError) as e:
            raise JobError(f"validation_file {vds.filename}: {e}") from e
        ctx.log(f"held-out set: validation_file {vds.filename}, {vp.rows} prompts")
        return HeldPrompts(prompts.dataset, vp.dataset, vp.row_numbers, {
            "source": "validation_file", "validation_file": vds.id, "filename": vds.filename,
            "rows": vp.rows, "training_rows": prompts.rows,
            "row_numbers": vp.row_numbers[:MAX_LISTED_ROWS]}, vp.answer_column)
    train, held, rows, info = split(ctx, spec, prompts.dataset, prompts.row_numbers, "prompts")
    return HeldPrompts(train, held, rows, info, prompts.answer_column)


def evaluate(ctx: JobContext, spec, held: HeldPrompts, model, tokenizer) -> dict[str, Any]:
    """The reward eval table of ``model`` (a PEFT model: its adapter is "after", the adapter
    disabled "before") on up to ``spec.reward_eval_samples`` held-out prompts, scored by the
    run's reward functions (built afresh, closed after). Raises RewardError."""
    from worker.engine.reward_eval import reward_eval
    from worker.rewards.registry import build

    functions = build(spec, held.answer_column)
    kinds = {f.name: r.name for f, r in zip(functions, spec.rewards)}
    n = min(spec.reward_eval_samples, len(held.held))
    ctx.progress("reward_eval", 0, 1, f"greedy completions of {n} held-out prompts, base and "
                                      "fine-tuned")
    try:
        table = reward_eval(model, tokenizer, held.held, held.row_numbers, functions, kinds, n,
                            spec.max_prompt_length, spec.max_completion_length,
                            held.answer_column, check=ctx.check, on_log=ctx.log)
    finally:
        for f in functions:
            f.close()
    ctx.progress("reward_eval", 1, 1)
    s = table["summary"]
    acc = "".join(f"; accuracy ({a['function']}) {a['base']} -> {a['fine_tuned']}"
                  for a in s["accuracy"])
    ctx.log(f"reward eval on {s['samples']} held-out prompts: mean reward {s['base_reward']} "
            f"(base) -> {s['fine_tuned_reward']} (fine-tuned){acc}")
    return table


def finish(ctx: JobContext, run_id: str, run_dir: Path, spec, held: HeldPrompts, model,
           tokenizer) -> dict[str, Any]:
    """The result's ``eval`` and ``reward_eval`` entries after training (empty without a
    held-out set); writes ``eval.json`` (artifact ``eval``). A reward that fails here is a
    warning, not a failed run: the adapter is already saved."""
    from worker.jobs.common import add_artifact, atomic_write
    from worker.rewards.base import RewardError

    if held.held is None:
        return {}
    out: dict[str, Any] = {"eval": held.info}
    if spec.reward_eval_samples:
        try:
            out["reward_eval"] = evaluate(ctx, spec, held, model, tokenizer)
        except RewardError as e:
            ctx.log(f"reward eval skipped: {e}", "warning")
            out["reward_eval"] = {"error": str(e)}
    path = run_dir / "eval.json"
    atomic_write(path, json.dumps(out, indent=2))
    if not repo.list_artifacts(ctx.engine, run_id, kind="eval"):
        add_artifact(ctx, run_id, "eval", path)
    return out
