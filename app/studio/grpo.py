"""GRPO runs: permission for custom rewards, column checks against the prompt dataset, creation.

Every surface (the GRPO form, ``POST /api/runs/grpo``, the OpenAI reinforcement method) calls
:func:`create_grpo_run`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.data.errors import DatasetError
from app.settings import Settings
from app.store import repo
from app.store.schema import Dataset, Job, Run
from app.store.specs import GrpoSpec
from app.studio import audit, calibration, evaluation
from app.studio.errors import StudioError, invalid
from app.studio.runs import (check_num_gpus, check_qlora_device, check_targets,
                             resolved_template, run_name, usable_dataset, usable_model)
from app.studio.seqlen import fit_grpo_lengths

if TYPE_CHECKING:
    from app.store.schema import User


def custom_rewards_allowed(actor: User) -> bool:
    """Whether ``actor`` may run custom Python reward code (in the worker's sandbox): the users,
    admins included, whose ``can_run_custom_rewards`` flag an admin has set on the Admin page."""
    return bool(actor is not None and not actor.disabled and actor.can_run_custom_rewards)


def create_grpo_run(engine: Engine, settings: Settings, actor: User, spec: GrpoSpec,
                    name: str | None = None) -> tuple[Run, Job]:
    """Check permission, model (a prompt and its completion must fit its context window:
    :func:`app.studio.seqlen.fit_grpo_lengths`), dataset and columns,
    resolve the chat template, then create the run (owned by ``actor``) and queue its ``grpo`` job.

    Raises:
        StudioError: forbidden (field ``rewards``) for custom rewards the actor may not run;
            not_found for an unknown or another user's model/dataset/validation_file; invalid
            otherwise (held-out rules: :func:`app.studio.evaluation.check_held_out`; code
            ``too_big_for_gpus`` when the estimated GPU memory exceeds the largest live GPU).
    """
    name = run_name(name)
    if spec.has_custom_rewards and not custom_rewards_allowed(actor):
        raise StudioError("forbidden", "custom Python rewards are not allowed for this user; an "
                                       "admin can allow them on the Admin page", "rewards")
    model = usable_model(engine, actor, spec)
    spec = resolved_template(fit_grpo_lengths(spec, model), model)
    check_targets(spec, model)
    ds = usable_dataset(engine, actor, spec)
    spec = with_dataset_columns(spec, ds)
    check_columns(spec, ds)
    check_numeric_references(spec, ds)
    evaluation.check_held_out(engine, actor, spec, ds.rows)
    check_qlora_device(engine, settings, spec)
    check_num_gpus(engine, settings, spec)
    estimate_gib = calibration.for_new_run(engine, settings, model, spec, "grpo", actor)
    run, job = repo.create_run(engine, spec, kind="grpo", name=name, owner=actor.id,
                               estimate_gib=estimate_gib)
    audit.record(engine, actor.id, "run.created", "run", run.id, kind="grpo", model=model.name,
                 dataset=ds.id, custom_rewards=spec.has_custom_rewards)
    return run, job


#: Rewards that read a reference column (``params.column``, else the run's answer column).
_NEEDS_REFERENCE = ("numeric_match", "exact_match", "text_similarity")


def dataset_columns(ds: Dataset) -> list[str] | None:
    """The dataset's columns: from its prompt report, else the first readable rows of its file;
    None when the file cannot be read (the worker then reports the problem)."""
    cols = (ds.report or {}).get("columns") if ds.format == "prompts" else None
    if cols:
        return list(cols)
    from app.data.loader import iter_records

    seen: dict[str, None] = {}
    try:
        for i, rec in enumerate(iter_records(ds.path)):
            if isinstance(rec.data, dict):
                seen.update(dict.fromkeys(rec.data))
            if i >= 50:
                break
    except Exception:  # noqa: BLE001 - unreadable here is reported by the job
        return None
    return list(seen) or None


def check_columns(spec: GrpoSpec, ds: Dataset) -> None:
    """Refuse a run whose prompt/answer column or reward columns the dataset lacks.

    Raises StudioError(invalid) (``prompt_column``, ``answer_column`` or ``rewards[i].params.column``)
    naming the reward and listing the dataset's columns.
    """
    cols = dataset_columns(ds)
    if not cols:
        return
    have = f"dataset {ds.filename!r} has columns: {', '.join(cols)}"
    for field in ("prompt_column", "answer_column"):
        col = getattr(spec, field)
        if col and col not in cols:
            raise invalid(field, f"column {col!r} is not in the dataset ({have})")
    answer = spec.answer_column
    if not answer:
        from app.data.prompts import pick_columns

        try:
            answer = pick_columns(dict.fromkeys(cols), spec.prompt_column)[1]
        except DatasetError as exc:
            raise invalid("prompt_column", str(exc)) from None
    for i, r in enumerate(spec.rewards):
        col = (r.params or {}).get("column")
        label = r.label or r.name
        if col and col not in cols:
            raise invalid(f"rewards[{i}].params.column",
                             f"reward {label!r} reads column {col!r}, which is not in the "
                             f"dataset ({have})")
        if not col and r.name in _NEEDS_REFERENCE and not answer:
            raise invalid(f"rewards[{i}].params.column",
                             f"reward {label!r} needs a reference column: the dataset has no "
                             f"answer column; name one with answer_column or the reward's "
                             f"column ({have})")


def _numbers(ds: Dataset | None) -> dict[str, dict[str, Any]] | None:
    """Which columns of a prompt dataset hold a reference number, from its report
    (:class:`app.data.answers.NumberCount`); None when not known (another format, or a report
    made before it was counted)."""
    if ds is None or ds.format != "prompts":
        return None
    return (ds.report or {}).get("numbers")


def check_numeric_references(spec: GrpoSpec, ds: Dataset) -> None:
    """Refuse ``numeric_match`` on a column where a row holds no number (the reward raises at
    the first such row it scores, failing the run at its first steps, after its wait in the
    queue), naming the row and the rewards that fit text answers.

    Raises StudioError(invalid) (field ``rewards[i]``)."""
    numbers = _numbers(ds)
    if not numbers:
        return
    answer = spec.answer_column or (ds.report or {}).get("answer_column")
    for i, r in enumerate(spec.rewards):
        col = (r.params or {}).get("column") or answer
        c = numbers.get(col) if r.name == "numeric_match" and col else None
        if not c or c.get("first_without") is None:
            continue
        label, row, example = r.label or r.name, c["first_without"], c.get("example")
        seen = (f"no row of column {col!r} holds one" if not c["with_number"] else
                f"{c['with_number']:,} of {c['rows']:,} rows of column {col!r} "
                f"{'holds' if c['with_number'] == 1 else 'hold'} one")
        raise invalid(f"rewards[{i}]",
                      f"reward {label!r} compares the number in a completion with the number "
                      f"in the reference, but {seen}: row {row} has none ({example!r}); for "
                      "text answers choose exact_match or text_similarity, or name another "
                      "answer_column")


def default_rewards(ds: Dataset | None) -> list[str]:
    """The reward functions the GRPO form ticks for prompt dataset ``ds``: ``numeric_match``
    and ``format`` where every reference holds a number (GSM8K-like), or nothing is known of
    it; ``text_similarity`` and ``format`` for text references; ``format`` without an answer
    column."""
    numbers = _numbers(ds)
    if numbers is None:
        return ["numeric_match", "format"]
    answer = (ds.report or {}).get("answer_column")
    if not answer:
        return ["format"]
    c = numbers.get(answer)
    if c and c.get("first_without") is None and c.get("rows"):
        return ["numeric_match", "format"]
    return ["text_similarity", "format"]


def with_dataset_columns(spec: GrpoSpec, ds: Dataset) -> GrpoSpec:
    """``spec`` with the prompt/answer columns chosen when the prompt dataset was uploaded
    filled in where the run names none (an upload may name a column auto-detection misses)."""
    report = ds.report or {}
    if ds.format != "prompts" or not report.get("prompt_column"):
        return spec
    update = {}
    if not spec.prompt_column:
        update["prompt_column"] = report["prompt_column"]
    if not spec.answer_column and report.get("answer_column") \
            and spec.prompt_column in (None, report["prompt_column"]):
        update["answer_column"] = report["answer_column"]
    return spec.model_copy(update=update) if update else spec
