"""The OpenAI fine-tuning ``method={"type": "reinforcement", ...}`` shape for GRPO runs.

``fine_tuning.jobs.create`` with a reinforcement method is mapped onto a :class:`GrpoSpec` (the
graders onto our rewards, see :mod:`app.web.openai.graders`) and created like a run from the GRPO form;
the job object echoes the method and its hyperparameters.
"""
from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from app.settings import Settings
from app.store import repo
from app.store.specs import GrpoSpec, field_bound
from app.studio import runs as runs_uc
from app.studio.grpo import create_grpo_run
from app.studio.epochs import EPOCHS_OR_STEPS
from app.web.errors import ApiError
from app.web.openai.graders import bad_value, grader_rewards, object_param
from app.web.openai.shapes import job_object


def spec_from_reinforcement(body: dict[str, Any], engine) -> dict[str, Any]:
    """GrpoSpec input from an OpenAI job-create body with ``method.type == "reinforcement"``.

    ``hyperparameters`` (under ``method.reinforcement`` or top level): ``batch_size`` ->
    per_device_train_batch_size, ``learning_rate_multiplier`` × our default learning rate,
    ``n_epochs`` -> max_steps from the dataset's row count; any GrpoSpec field name passes
    through (num_generations, beta, ...). Raises ApiError.
    """
    for key in ("model", "training_file"):
        if not body.get(key) or not isinstance(body.get(key), str):
            raise ApiError(400, f"{key} is required", key, "missing_required_parameter")
    rl = (body.get("method") or {}).get("reinforcement") or {}
    if not isinstance(rl, dict) or "grader" not in rl:
        raise ApiError(400, "method.reinforcement.grader is required",
                       "method.reinforcement.grader", "missing_required_parameter")
    raw: dict[str, Any] = {"model": body["model"], "dataset": body["training_file"],
                           "rewards": grader_rewards(rl["grader"]), "grader": rl["grader"]}
    hp = {**object_param(body.get("hyperparameters"), "hyperparameters"),
          **object_param(rl.get("hyperparameters"), "method.reinforcement.hyperparameters")}
    epochs = None
    for key, value in hp.items():
        if value in (None, "auto") or key in ("compute_multiplier", "eval_interval",
                                              "eval_samples", "reasoning_effort"):
            continue
        if key == "batch_size":
            raw["per_device_train_batch_size"] = value
        elif key == "learning_rate_multiplier":
            raw["learning_rate"] = runs_uc.learning_rate_from_multiplier(GrpoSpec, value)
        elif key == "n_epochs":
            epochs = value
        elif key in GrpoSpec.model_fields and key not in ("model", "dataset", "rewards",
                                                          "grader", "n_epochs"):
            raw[key] = value
        else:
            raise ApiError(400, f"unknown hyperparameter {key!r}", f"hyperparameters.{key}",
                           "unknown_parameter")
    for key, value in body.items():
        if key in GrpoSpec.model_fields and key not in ("model", "dataset", "rewards",
                                                        "spec_version", "n_epochs", "grader"):
            raw[key] = value
    if body.get("seed") is not None:
        raw["seed"] = body["seed"]
    if epochs is not None and "max_steps" in raw:
        raise bad_value(EPOCHS_OR_STEPS, "hyperparameters.n_epochs")
    if epochs is not None:
        try:
            rows = repo.get_dataset(engine, body["training_file"]).rows
        except repo.NotFound:
            rows = None
        sizes = _step_sizes(raw)
        if rows and sizes:
            per, acc, gen = sizes
            try:
                steps = max(1, -(-int(float(epochs) * rows * gen) // (per * acc)))
            except (TypeError, ValueError, OverflowError):
                raise bad_value("n_epochs must be a number", "hyperparameters.n_epochs") from None
            top = field_bound(GrpoSpec, "max_steps")
            if "max_steps" not in raw and top is not None and steps > top:
                raise bad_value(f"n_epochs={epochs} over {rows} prompts × {gen} generations at "
                                f"{per * acc} completions per step is {steps} steps, above the "
                                f"{top:,} cap", "hyperparameters.n_epochs")
            if "max_steps" not in raw:
                raw["max_steps"], raw["n_epochs"] = steps, epochs
    return raw


def _step_sizes(raw: dict[str, Any]) -> tuple[int, int, int] | None:
    """``(per_device_train_batch_size, gradient_accumulation_steps, num_generations)`` of
    ``raw`` (the GrpoSpec defaults where absent), or None when one is not a whole number >= 1:
    the spec's own validation then names that field."""
    d = GrpoSpec.model_fields
    out = []
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations"):
        value = raw.get(name, d[name].default)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return None
        try:
            n = int(value)
        except ValueError:
            return None
        if n < 1:
            return None
        out.append(n)
    return out[0], out[1], out[2]


def create_reinforcement_job(engine: Engine, settings: Settings, user, body: dict[str, Any]
                             ) -> dict[str, Any]:
    """POST /v1/fine_tuning/jobs with ``method.type == "reinforcement"``: a GRPO run owned by
    ``user``; answers the OpenAI job object. Raises ApiError (the request's shape) or
    StudioError (the run's rules)."""
    spec = runs_uc.parse_spec(GrpoSpec, spec_from_reinforcement(body, engine))
    run, job = create_grpo_run(engine, settings, user, spec, body.get("suffix"))
    return job_object(engine, run, job)
