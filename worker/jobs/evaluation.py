"""The ``train`` job's held-out evaluation (see :mod:`worker.engine.evaluation`): which rows are
held out, what config.json and the result record of it, and the generation eval at the end.

Result entries (when the run has a held-out set): ``eval`` (where the held-out rows came from,
their count and row numbers, evaluations, first/last eval loss, ``best_step``,
``best_eval_loss``, ``best_checkpoint``, ``early_stopped``) and, with
``generation_eval_samples``, ``generation_eval`` (``rows`` and ``summary``; also written to
``eval.json``, artifact ``eval``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.store import repo
from worker.context import JobContext, JobError

#: Held-out row numbers listed in config.json and the result (the count is always exact).
MAX_LISTED_ROWS = 1000
#: Longest greedy answer of the generation eval (tokens; also at most the reference + 16).
MAX_NEW_TOKENS = 256


@dataclass
class HeldOut:
    """The training rows, the held-out rows (None: no evaluation) and what to record of them."""

    train_dataset: Any
    eval_dataset: Any = None
    row_numbers: list[int] = field(default_factory=list)
    info: dict[str, Any] | None = None


def prepare(ctx: JobContext, spec, enc, model_row, template: str | None,
            tokenizer_dir: str | None = None) -> HeldOut:
    """Split ``enc`` (the encoded training set) or encode the ``validation_file`` the same way
    (template, max_seq_length, train_on_responses_only, the tokenizer in ``tokenizer_dir``:
    default the model's); logs what was held out.

    Raises JobError: the validation file is gone or has no trainable row, or the percentage
    leaves no row to train on."""
    from app.data.errors import DatasetError
    from worker.engine import data as edata

    if not spec.has_held_out:
        return HeldOut(enc.dataset)
    if spec.validation_file:
        try:
            vds = repo.get_dataset(ctx.engine, spec.validation_file)
        except repo.NotFound:
            raise JobError(f"validation_file {spec.validation_file} no longer exists") from None
        mapping = (vds.report or {}).get("column_mapping")
        try:
            venc = edata.build_dataset(vds.path, tokenizer_dir or model_row.path, template,
                                       spec.max_seq_length, spec.train_on_responses_only, None,
                                       check=ctx.check,
                                       **({"column_mapping": mapping} if mapping else {}))
        except DatasetError as e:
            raise JobError(f"validation_file {vds.filename}: {e}") from e
        ctx.log(f"held-out set: validation_file {vds.filename}, {venc.rows} rows, "
                f"{venc.tokens} tokens")
        return HeldOut(enc.dataset, venc.dataset, venc.row_numbers, {
            "source": "validation_file", "validation_file": vds.id, "filename": vds.filename,
            "rows": venc.rows, "training_rows": enc.rows,
            "row_numbers": venc.row_numbers[:MAX_LISTED_ROWS]})
    return HeldOut(*split(ctx, spec, enc.dataset, enc.row_numbers))


def split(ctx: JobContext, spec, dataset, row_numbers: list[int], what: str = "rows"
          ) -> tuple[Any, Any, list[int], dict[str, Any]]:
    """(training rows, held-out rows, the held-out rows' numbers in the file, what the result
    records) of ``dataset``: ``spec.validation_split_percentage`` of it chosen by a shuffle
    seeded with ``spec.seed`` (:func:`worker.engine.evaluation.split_held_out`); logged.
    Raises JobError when nothing would be left to train on."""
    from worker.engine.evaluation import split_held_out

    pct, n = spec.validation_split_percentage, len(dataset)
    try:
        train_idx, held_idx = split_held_out(n, pct, spec.seed)
    except ValueError as e:
        raise JobError(f"validation_split_percentage: {e}") from None
    rows = [row_numbers[i] for i in held_idx] if row_numbers else []
    ctx.log(f"held-out set: {pct:g}% of the dataset, {len(held_idx)} of {n} {what} "
            f"(shuffled with seed {spec.seed}); training on {len(train_idx)}")
    return dataset.select(train_idx), dataset.select(held_idx), rows, {
        "source": "validation_split_percentage", "percentage": pct, "seed": spec.seed,
        "rows": len(held_idx), "training_rows": len(train_idx),
        "row_numbers": rows[:MAX_LISTED_ROWS]}


def finish(ctx: JobContext, run_id: str, run_dir: Path, spec, held: HeldOut, reporter,
           trainer, tokenizer, start_step: int = 0) -> dict[str, Any]:
    """The result's ``eval`` (and ``generation_eval``) entries after training, over every
    attempt of a run resumed at ``start_step``; runs the generation eval when the spec asks
    for it and records ``eval.json`` as artifact ``eval``."""
    if held.eval_dataset is None or reporter is None:
        return {}
    from worker.jobs.common import earlier_metric

    earlier = earlier_metric(ctx, start_step, "eval_loss", first_step=0)
    out: dict[str, Any] = {"eval": {**(held.info or {}), **reporter.summary(earlier)}}
    best = out["eval"].get("best_checkpoint")
    if best:
        chosen = " (its weights are the adapter: load_best_model_at_end)" \
            if spec.load_best_model_at_end else ""
        ctx.log(f"best checkpoint: {best}, eval_loss {out['eval']['best_eval_loss']:.4g}{chosen}")
    if out["eval"]["early_stopped"]:
        ctx.log(f"early stopping: eval_loss did not improve for {spec.early_stopping_patience} "
                f"evaluation(s); stopped at step {trainer.state.global_step}")
    n = spec.generation_eval_samples
    if n:
        gen = generation_table(ctx, trainer.model, tokenizer, held, n)
        path = run_dir / "eval.json"
        from worker.jobs.common import add_artifact, atomic_write

        atomic_write(path, json.dumps({"eval": out["eval"], "generation_eval": gen}, indent=2))
        if not repo.list_artifacts(ctx.engine, run_id, kind="eval"):
            add_artifact(ctx, run_id, "eval", path)
        out["generation_eval"] = gen
    return out


def generation_table(ctx: JobContext, model, tokenizer, held: HeldOut, n: int,
                     tuned: str = "fine-tuned") -> dict[str, Any]:
    """The generation eval of ``model`` (its adapter vs the adapter disabled) on up to ``n`` of
    the held-out rows (:func:`worker.engine.evaluation.generation_eval`), with progress events
    and a log line naming ``tuned``."""
    from worker.engine.evaluation import generation_eval

    ctx.progress("generation_eval", 0, 1, f"greedy answers on {n} held-out prompts")
    gen = generation_eval(model, tokenizer, held.eval_dataset, held.row_numbers, n,
                          MAX_NEW_TOKENS, check=ctx.check, on_log=ctx.log)
    ctx.progress("generation_eval", 1, 1)
    s = gen["summary"]
    ctx.log(f"generation eval on {s['samples']} held-out prompts: exact match "
            f"{s['base_exact_match']} (base) -> {s['fine_tuned_exact_match']} ({tuned}), "
            f"token F1 {s['base_token_f1']} -> {s['fine_tuned_token_f1']}")
    return gen
