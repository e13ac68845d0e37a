"""Comparing two runs: their configuration diff, their curves (an SFT run's loss and eval loss;
a GRPO run's mean reward, per reward function and overall, and its KL to the reference: a GRPO
loss is not a figure two runs are compared by) and their evaluation results, for the compare page
(``/runs/compare?a=…&b=…``) and ``/api/runs/{a}/compare?other={b}``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.store import events, repo
from app.studio import access, evaluation, train_time
from app.studio.errors import invalid
from app.studio.run_labels import run_tags, short_date
from app.studio.datasets import shown_name
from app.studio.runs import input_names

if TYPE_CHECKING:
    from app.store.schema import Job, Run, User

#: Spec keys the diff leaves out (the chat template's source is compared by its name).
NOT_DIFFED = ("spec_version", "chat_template")
#: Each result figure a side shows, in order, with the words the page labels it by (units
#: named: ``train_runtime`` is seconds over all attempts, the page shows it as a duration).
RESULT_LABELS = {"steps": "steps", "first_loss": "first loss", "final_loss": "final loss",
                 "train_loss": "mean train loss", "first_reward": "first mean reward",
                 "final_reward": "final mean reward", "train_runtime": "training time"}
#: The result figures that mean something for each kind of run.
KIND_RESULTS = {"sft": ("steps", "first_loss", "final_loss", "train_loss", "train_runtime"),
                "grpo": ("steps", "first_reward", "final_reward", "train_runtime")}
#: Spec fields that name a row of another table: the diff says its name, then the id.
NAMED_FIELDS = {"model": "model", "dataset": "dataset", "validation_file": "dataset"}
#: The runs the compare page's pickers list (newest first).
RUNS_LISTED = 500


def run_choices(engine: Engine, actor: User) -> list[dict[str, str]]:
    """The actor's runs for the pickers, newest first: ``[{"id", "label"}]``, labelled as
    :mod:`app.studio.run_labels` names them (runs sharing a name get ``[short id, date]``),
    then the kind (and the date, for a name no other run has): ``alpaca [3f9a1c, 12-01
    22:05] · sft`` or ``wider · sft · 12-01 22:07``."""
    runs = repo.list_runs(engine, RUNS_LISTED, owner=access.owner_filter(actor))
    tags = run_tags(runs)
    return [{"id": r.id, "label": f"{tags[r.id]} · {r.kind}"
             + (f" · {short_date(r.created_at)}" if tags[r.id] == r.name else "")}
            for r in runs]


def curves(engine: Engine, job: Job | None) -> dict[str, Any]:
    """A training job's curves from its metric events, each ``[[step, value], ...]`` in step
    order (a step reported twice keeps its newest value): ``loss``, ``eval_loss``, and for GRPO
    ``reward`` (the step's mean reward over its completions), ``kl`` and ``rewards``
    (``{function name: [[step, mean], ...]}``, from the ``reward/<name>`` figures)."""
    series: dict[str, dict[int, float]] = {k: {} for k in ("loss", "eval_loss", "reward", "kl")}
    per_function: dict[str, dict[int, float]] = {}
    last = 0
    while job is not None:
        batch = events.since(engine, job.id, last, 5000, types=["metric"])
        if not batch:
            break
        for ev in batch:
            d, step = ev.data or {}, (ev.data or {}).get("step")
            if not isinstance(step, (int, float)) or isinstance(step, bool):
                continue
            for key, value in d.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                if key in series:
                    series[key][int(step)] = float(value)
                elif key.startswith("reward/"):
                    per_function.setdefault(key[len("reward/"):], {})[int(step)] = float(value)
        last = batch[-1].id

    def pairs(points: dict[int, float]) -> list[list[float]]:
        return [[s, points[s]] for s in sorted(points)]

    return {**{k: pairs(v) for k, v in series.items()},
            "rewards": {name: pairs(v) for name, v in sorted(per_function.items())}}


def value_label(field: str, value: Any, engine: Engine) -> str | None:
    """How the diff names ``value`` of spec ``field`` when its raw value does not read well:
    a model or dataset id as ``"<name> (<id>)"``; the ``rewards`` list as ``"name ×weight
    (param=value, ...)"`` entries joined by ``"; "``; None for every other value."""
    if field in NAMED_FIELDS and isinstance(value, str):
        from app.store import repo

        try:
            if NAMED_FIELDS[field] == "model":
                name = repo.get_model(engine, value).name
            else:
                name = shown_name(repo.get_dataset(engine, value, deleted=True))
        except repo.NotFound:
            return None
        return f"{name} ({value})"
    if field == "rewards" and isinstance(value, list):
        out = []
        for f in value:
            if not isinstance(f, dict):
                return None
            params = {k: v for k, v in (f.get("params") or {}).items()}
            if f.get("label"):
                params = {"label": f["label"], **params}
            weight = f.get("weight")
            out.append(f"{f.get('name')} ×{1 if weight is None else weight:g}"
                       + (" (" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"
                          if params else ""))
        return "; ".join(out)
    return None


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The spec fields whose values differ: ``[{"field", "a", "b"}, ...]`` sorted by field (a
    field one spec lacks shows None)."""
    keys = sorted((set(a) | set(b)) - set(NOT_DIFFED))
    return [{"field": k, "a": a.get(k), "b": b.get(k)} for k in keys if a.get(k) != b.get(k)]


def _side(engine: Engine, run: Run, job: Job | None, label: str) -> dict[str, Any]:
    model, dataset = input_names(engine, run)
    result = dict((job.result or {}) if job is not None else {})
    # a resumed run's time is the sum over its attempts, not the last attempt's train_runtime
    result["train_runtime"] = (train_time.training_time(engine, job) or {}).get("all_attempts")
    curve = curves(engine, job)
    kind = "grpo" if run.kind == "grpo" else "sft"
    main = curve["reward"] if kind == "grpo" else curve["loss"]
    first, final = ("first_reward", "final_reward") if kind == "grpo" else ("first_loss",
                                                                             "final_loss")
    if main:  # a cancelled or failed run has no result: its curve tells
        for k, v in (("steps", main[-1][0]), (first, main[0][1]), (final, main[-1][1])):
            result[k] = v if result.get(k) is None else result[k]
    return {"id": run.id, "name": run.name, "label": label, "kind": run.kind, "model": model,
            "dataset": dataset, "state": job.state if job else None,
            "created_at": run.created_at, "curves": curve,
            "result": {k: result.get(k) for k in KIND_RESULTS[kind]
                       if result.get(k) is not None},
            "evaluation": evaluation.run_evaluation(engine, run, job)}


def compare_runs(engine: Engine, actor: User, a: str, b: str) -> dict[str, Any]:
    """Two of the actor's runs side by side: ``{"a": side, "b": side, "diff": [...]}``; each
    side has the run's ``id``, ``name``, ``label`` (its name, with ``[short id, date]`` when
    both runs share it), ``kind``, ``model``, ``dataset``, ``state``,
    ``curves`` (:func:`curves`), ``result`` (the :data:`KIND_RESULTS` figures of its kind it
    has: ``steps``, ``first_loss`` and ``final_loss`` (SFT) or ``first_reward`` and
    ``final_reward`` (GRPO; each from the curve when the job left no result, e.g. a cancelled
    run), ``train_loss``, ``train_runtime`` in seconds) and ``evaluation``
    (:func:`app.studio.evaluation.run_evaluation`, None without a held-out set). Each ``diff``
    row may carry ``a_label``/``b_label`` (:func:`value_label`: names for ids, rewards in
    words).

    Raises:
        StudioError: not_found (either run unknown or another user's, checked first, so
            another user's run named twice is a 404 too); invalid (field ``b``) when both
            are the same run of the actor's.
    """
    run_a, job_a = access.run_with_job(engine, actor, a)  # another user's run: 404 first
    run_b, job_b = access.run_with_job(engine, actor, b)
    if a == b:
        raise invalid("b", "choose two different runs")
    diff = config_diff(run_a.spec or {}, run_b.spec or {})
    if (run_a.spec or {}).get("chat_template") != (run_b.spec or {}).get("chat_template") and \
            not any(d["field"] == "chat_template_name" for d in diff):
        diff.append({"field": "chat_template", "a": "(its own text)", "b": "(another text)"})
    for d in diff:
        for side in ("a", "b"):
            label = value_label(d["field"], d[side], engine)
            if label is not None:
                d[f"{side}_label"] = label
    tags = run_tags([run_a, run_b])
    return {"a": _side(engine, run_a, job_a, tags[run_a.id]),
            "b": _side(engine, run_b, job_b, tags[run_b.id]), "diff": diff}
