"""Held-out evaluation of SFT runs: the rules a spec's evaluation fields must meet when a run is
created, and what the run page and the APIs show of a run's evaluation.

The worker does the evaluating (:mod:`worker.jobs.evaluation`): eval loss every ``eval_steps``
as metric events with ``step`` and ``eval_loss``, the best evaluation when training ends
(``best_step``, ``best_eval_loss``, ``best_checkpoint``), and the result's ``eval`` and
``generation_eval`` entries.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.store import events
from app.store.specs import GrpoSpec, TrainSpec
from app.studio import access, validation
from app.studio.errors import StudioError, invalid

if TYPE_CHECKING:
    from app.settings import Settings
    from app.store.schema import Dataset, Job, Run, User

#: The fields that mean nothing without a held-out set (of a TrainSpec, of a GrpoSpec).
NEEDS_HELD_OUT = ("eval_steps", "per_device_eval_batch_size", "load_best_model_at_end",
                  "early_stopping_patience", "generation_eval_samples", "reward_eval_samples")
_HOW = "set validation_file (a held-out dataset) or validation_split_percentage"


def check_held_out(engine: Engine, actor: User, spec: TrainSpec | GrpoSpec,
                   train_rows: int | None) -> None:
    """Refuse evaluation settings that cannot work (an SFT or a GRPO spec).

    Raises StudioError (field named): not_found for a ``validation_file`` that is unknown or
    another user's; invalid for a validation_file that is the training dataset, not processed,
    a GRPO prompt dataset for an SFT run or one without the prompt, answer or reward columns
    for a GRPO run, for both a validation_file and a percentage, for a percentage
    that leaves no training row (``train_rows``: the dataset's valid rows), for evaluation
    settings without a held-out set, and for ``load_best_model_at_end`` when ``save_steps``
    is not a multiple of ``eval_steps`` (the best evaluation must have a checkpoint)."""
    if spec.validation_file and spec.validation_split_percentage:
        raise invalid("validation_split_percentage", "choose one held-out set: a "
                      "validation_file or a percentage of the dataset, not both")
    if spec.validation_file:
        validation_dataset(engine, actor, spec)
    elif spec.validation_split_percentage and train_rows is not None:
        held = max(1, round(train_rows * spec.validation_split_percentage / 100))
        if held >= train_rows:
            raise invalid("validation_split_percentage",
                          f"holding out {spec.validation_split_percentage:g}% of {train_rows} "
                          f"row{'s' if train_rows != 1 else ''} leaves none to train on")
    if not spec.has_held_out:
        defaults = type(spec).model_fields
        for name in NEEDS_HELD_OUT:
            if name in defaults and getattr(spec, name) != defaults[name].default:
                raise invalid(name, f"{name} needs a held-out set: {_HOW}")
        return
    if isinstance(spec, GrpoSpec):
        return
    steps = spec.eval_steps or spec.save_steps
    if spec.load_best_model_at_end and spec.save_steps % steps:
        raise invalid("save_steps", f"with load_best_model_at_end, save_steps ({spec.save_steps})"
                      f" must be a multiple of eval_steps ({steps}) so that the best evaluation "
                      "has a checkpoint to load")


def validation_dataset(engine: Engine, actor: User, spec: TrainSpec | GrpoSpec) -> Dataset:
    """The spec's ``validation_file`` dataset, if the actor may use it as a held-out set.
    Raises StudioError (field ``validation_file``): see :func:`check_held_out`."""
    if spec.validation_file == spec.dataset:
        raise invalid("validation_file", "the held-out set must not be the training dataset; "
                      "upload another file, or hold out a percentage with "
                      "validation_split_percentage")
    try:
        ds = access.dataset(engine, actor, spec.validation_file)
    except StudioError as exc:
        raise StudioError(exc.kind, exc.message, "validation_file") from None
    ds = validation.check_stale(engine, ds)
    if ds.status != "processed":
        why = validation.progress_text(ds) if ds.status == validation.VALIDATING \
            else ds.error or ds.status
        raise invalid("validation_file", f"dataset {ds.filename!r} is not usable: {why}")
    if isinstance(spec, GrpoSpec):
        from app.studio.grpo import check_columns

        try:
            check_columns(spec, ds)
        except StudioError as exc:
            raise invalid("validation_file", f"held-out prompts: {exc.message}") from None
        return ds
    if ds.format == "prompts":
        raise invalid("validation_file", f"dataset {ds.filename!r} is a GRPO prompt dataset "
                      "(no responses to score); use a dataset with answers")
    return ds


def held_out_text(spec: dict[str, Any], filenames: dict[str, str] | None = None) -> str | None:
    """One line saying where a run's held-out set comes from (None without one)."""
    if spec.get("validation_file"):
        name = (filenames or {}).get(spec["validation_file"]) or spec["validation_file"]
        return f"validation_file {name}"
    pct = spec.get("validation_split_percentage") or 0
    if pct:
        return f"{pct:g}% of the dataset, shuffled with seed {spec.get('seed')}"
    return None


def run_evaluation(engine: Engine, run: Run, job: Job | None, settings: Settings | None = None,
                   actor: User | None = None) -> dict[str, Any] | None:
    """What the run page's Evaluation card shows: ``held_out`` (where from), ``eval_steps``,
    ``result`` (the result's ``eval`` once the run ended: rows held out, best checkpoint, early
    stop), ``generation`` (rows + summary of the generation eval), ``rewards`` (a GRPO run's
    before/after reward eval), ``best`` (the best evaluation event, once training ended) and
    ``checkpoints`` (their on-demand evals: :func:`app.studio.checkpoint_eval.checkpoint_evals`;
    with ``settings``, whether ``actor`` can evaluate each under the GPU memory quota too).
    None when the run has no held-out set."""
    from app.studio.checkpoint_eval import checkpoint_evals

    spec = run.spec or {}
    if not (spec.get("validation_file") or spec.get("validation_split_percentage")):
        return None
    names = {}
    if spec.get("validation_file"):
        from app.store import repo

        try:
            from app.studio.datasets import shown_name

            names[spec["validation_file"]] = shown_name(
                repo.get_dataset(engine, spec["validation_file"], deleted=True))
        except repo.NotFound:
            pass
    result = (job.result or {}) if job is not None else {}
    best = None
    if job is not None:
        for ev in events.recent(engine, job.id, "metric", 5):
            if "best_step" in (ev.data or {}) or "early_stopped" in (ev.data or {}):
                best = ev.data
                break
    return {"held_out": held_out_text(spec, names),
            "eval_steps": spec.get("eval_steps") or spec.get("save_steps"),
            "load_best_model_at_end": bool(spec.get("load_best_model_at_end")),
            "early_stopping_patience": spec.get("early_stopping_patience"),
            "result": result.get("eval"), "generation": result.get("generation_eval"),
            "rewards": result.get("reward_eval"), "best": best,
            "checkpoints": checkpoint_evals(engine, run, settings, actor)}


def latest_training_metric(engine: Engine, job_id: int) -> dict[str, Any] | None:
    """The newest metric event of a job that is a training step (has ``loss``) or, when none of
    the last few is, the newest metric of any kind (an evaluation's carries no ``loss``)."""
    recent = events.recent(engine, job_id, "metric", 10)
    for ev in recent:
        if "loss" in (ev.data or {}):
            return ev.data
    return recent[0].data if recent else None
