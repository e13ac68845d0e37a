"""The OpenAI fine-tuning ``method={"type": "reinforcement", ...}`` shape for GRPO runs.

``fine_tuning.jobs.create`` with a reinforcement method is mapped onto a :class:`GrpoSpec` (the
graders onto our rewards, see :mod:`app.web.graders`) and created like a run from the GRPO form;
the job object echoes the method and its hyperparameters.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from app.store import repo
from app.store.specs import GrpoSpec
from app.web.deps import get_engine, get_settings
from app.web.errors import ApiError
from app.web.graders import bad_value, grader_rewards
from app.web.routes.grpo import create_grpo_run, current_user
from app.web.routes.runs import FieldError

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
    hp = {**(body.get("hyperparameters") or {}), **(rl.get("hyperparameters") or {})}
    epochs = None
    for key, value in hp.items():
        if value in (None, "auto") or key in ("compute_multiplier", "eval_interval",
                                              "eval_samples", "reasoning_effort"):
            continue
        if key == "batch_size":
            raw["per_device_train_batch_size"] = value
        elif key == "learning_rate_multiplier":
            try:
                raw["learning_rate"] = float(value) * GrpoSpec.model_fields["learning_rate"].default
            except (TypeError, ValueError):
                raise bad_value("learning_rate_multiplier must be a number",
                           "hyperparameters.learning_rate_multiplier") from None
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
    if epochs is not None:
        try:
            rows = repo.get_dataset(engine, body["training_file"]).rows
        except repo.NotFound:
            rows = None
        if rows:
            d = GrpoSpec.model_fields
            per = int(raw.get("per_device_train_batch_size", d["per_device_train_batch_size"].default))
            acc = int(raw.get("gradient_accumulation_steps", d["gradient_accumulation_steps"].default))
            gen = int(raw.get("num_generations", d["num_generations"].default))
            try:
                steps = max(1, -(-int(float(epochs) * rows * gen) // (per * acc)))
            except (TypeError, ValueError):
                raise bad_value("n_epochs must be a number", "hyperparameters.n_epochs") from None
            cap = GrpoSpec.model_fields["max_steps"].metadata
            top = next((m.le for m in cap if getattr(m, "le", None) is not None), None)
            if "max_steps" not in raw and top is not None and steps > top:
                raise bad_value(f"n_epochs={epochs} over {rows} prompts × {gen} generations at "
                                f"{per * acc} completions per step is {steps} steps, above the "
                                f"{top:,} cap", "hyperparameters.n_epochs")
            if "max_steps" not in raw:
                raw["max_steps"], raw["n_epochs"] = steps, epochs
    return raw


def create_reinforcement_job(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/fine_tuning/jobs with ``method.type == "reinforcement"`` (the OpenAI job object)."""
    from app.web.routes.openai_api import job_object

    engine = get_engine(request)
    raw = spec_from_reinforcement(body, engine)
    try:
        spec = GrpoSpec(**raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        raise ApiError(400, f"{loc}: {msg}" if loc else msg, loc or None, "invalid_value") from None
    try:
        run, job = create_grpo_run(engine, get_settings(request), spec, body.get("suffix"),
                                   current_user(request))
    except FieldError as exc:
        if exc.field == "rewards":
            raise ApiError(403, exc.message, "method.reinforcement.grader", "permission_denied") from None
        if exc.field.startswith("rewards") or exc.field.endswith("_column"):
            param = ("method.reinforcement.grader" if exc.field.startswith("rewards")
                     else exc.field)
            raise ApiError(400, exc.message, param, "invalid_value") from None
        param = {"model": "model", "dataset": "training_file"}.get(exc.field, exc.field)
        code = {"model": "model_not_found", "dataset": "file_not_found"}.get(exc.field,
                                                                             "invalid_value")
        raise ApiError(404 if exc.message.startswith("no ") else 400, exc.message, param,
                       code) from None
    return job_object(engine, run, job)


def reinforcement_hyperparameters(spec: dict[str, Any]) -> dict[str, Any]:
    """A GRPO run's OpenAI ``hyperparameters``: the learning-rate multiplier is relative to the
    GRPO default learning rate (as when the job was created); ``n_epochs`` as sent, if any."""
    default_lr = GrpoSpec.model_fields["learning_rate"].default
    return {"batch_size": spec.get("per_device_train_batch_size"),
            "learning_rate_multiplier": round(spec.get("learning_rate", default_lr) / default_lr, 10),
            "n_epochs": spec.get("n_epochs")}


def reinforcement_method(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``method`` of a GRPO run's OpenAI job object: the grader the job was created with
    (None for runs made with our own rewards) and the rewards it was mapped onto."""
    return {"type": "reinforcement",
            "reinforcement": {"hyperparameters": reinforcement_hyperparameters(spec),
                              "grader": spec.get("grader"),
                              "whetstone_rewards": json.loads(json.dumps(spec.get("rewards", [])))}}
