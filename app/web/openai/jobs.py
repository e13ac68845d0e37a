"""The OpenAI fine-tuning API under /v1, so the official ``openai`` client can drive the studio.

Files are datasets (``file-…``, see :mod:`app.web.routes.openai_files`); fine-tuning jobs are runs (``ftjob-…``). Our own TrainSpec
fields (``r``, ``lora_alpha``, ``max_steps``, ``target_modules``, …) are accepted as extra body
fields; ``hyperparameters`` n_epochs / batch_size / learning_rate_multiplier map onto
num_train_epochs / per_device_train_batch_size / learning_rate (× the default 2e-4);
``validation_file`` is the run's held-out set (``eval_steps``, ``load_best_model_at_end``,
``early_stopping_patience`` as extra body fields). Errors use
the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from app.store import events
from app.store.schema import Run
from app.store.specs import TrainSpec
from app.studio import access, epochs
from app.studio import runs as runs_uc
from app.studio.datasets import is_under
from app.studio.paging import after_cursor, page_limit
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.errors import ApiError, request_json
from app.web.openai.graders import object_param as _object
from app.web.openai.reinforcement import create_reinforcement_job
from app.web.openai.shapes import event_object, fine_tuned_model_id, job_object

router = APIRouter(prefix="/v1")
_IGNORED = {"integrations", "metadata", "suffix", "seed", "validation_file", "hyperparameters",
            "method", "model", "training_file"}


def spec_from_openai(body: dict[str, Any]) -> dict[str, Any]:
    """TrainSpec input from an OpenAI job-create body (hyperparameters + our extra fields)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key in ("model", "training_file"):
        if not body.get(key) or not isinstance(body.get(key), str):
            raise ApiError(400, f"{key} is required", key, "missing_required_parameter")
    validation_file = body.get("validation_file")
    if validation_file is not None and not isinstance(validation_file, str):
        raise ApiError(400, "validation_file must be a file id", "validation_file",
                       "invalid_value")
    hp: dict[str, Any] = _object(body.get("hyperparameters"), "hyperparameters")
    method = body.get("method")
    if method:
        if not isinstance(method, dict) or method.get("type", "supervised") != "supervised":
            raise ApiError(400, "method.type must be 'supervised' or 'reinforcement'", "method.type",
                           "unsupported_parameter")
        supervised = _object(method.get("supervised"), "method.supervised")
        hp.update(_object(supervised.get("hyperparameters"), "method.supervised.hyperparameters"))
    raw: dict[str, Any] = {"model": body["model"], "dataset": body["training_file"]}
    if validation_file:
        raw["validation_file"] = validation_file
    mapping = {"n_epochs": "num_train_epochs", "batch_size": "per_device_train_batch_size"}
    for key, value in hp.items():
        if value in (None, "auto"):
            continue
        if key in mapping:
            raw[mapping[key]] = value
        elif key == "learning_rate_multiplier":
            raw["learning_rate"] = runs_uc.learning_rate_from_multiplier(TrainSpec, value)
        elif key in TrainSpec.model_fields:
            raw[key] = value
        else:
            raise ApiError(400, f"unknown hyperparameter {key!r}", f"hyperparameters.{key}",
                           "unknown_parameter")
    if body.get("seed") is not None:
        raw["seed"] = body["seed"]
    for key, value in body.items():
        if key in _IGNORED:
            continue
        if key in TrainSpec.model_fields and key not in ("model", "dataset", "spec_version"):
            raw[key] = value
        else:
            raise ApiError(400, f"unknown parameter {key!r}", key, "unknown_parameter")
    steps = raw.get("max_steps")
    if hp.get("n_epochs") not in (None, "auto") and steps not in (None, -1, "-1"):
        raise ApiError(400, epochs.EPOCHS_OR_STEPS, "hyperparameters.n_epochs", "invalid_value")
    return raw


@router.post("/fine_tuning/jobs")
async def create_job(request: Request, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """Create a fine-tuning job: supervised (our TrainSpec fields as extra body fields) or, with
    ``method.type == "reinforcement"``, a GRPO run."""
    body = await request_json(request)
    suffix = body.get("suffix") if isinstance(body, dict) else None
    if suffix is not None and (not isinstance(suffix, str) or len(suffix) > 64):
        raise ApiError(400, "suffix: a string of at most 64 characters", "suffix",
                       "invalid_value")
    if isinstance(body, dict) and isinstance(body.get("method"), dict) \
            and body["method"].get("type") == "reinforcement":
        return await run_in_threadpool(create_reinforcement_job, engine, settings, user, body)
    spec = runs_uc.parse_spec(TrainSpec, spec_from_openai(body))
    run, job = await run_in_threadpool(runs_uc.create_sft_run, engine, settings, user, spec,
                                       body.get("suffix"))
    return job_object(engine, run, job)


def _run(engine, user, job_id: str) -> Run:
    try:
        return access.run(engine, user, job_id)
    except StudioError:
        raise ApiError(404, f"No fine-tuning job with id {job_id!r}", "fine_tuning_job_id",
                       "fine_tuning_job_not_found") from None


@router.get("/fine_tuning/jobs")
def list_jobs(engine: EngineDep, user: CurrentUser, after: str | None = None,
              limit: str | None = None):
    limit = page_limit(limit, 20, 100)
    runs = runs_uc.list_runs(engine, user, limit=limit + 1, after=after)
    page = runs[:limit]
    return {"object": "list", "data": [job_object(engine, r) for r in page],
            "has_more": len(runs) > limit}


@router.get("/fine_tuning/jobs/{job_id}")
def retrieve_job(job_id: str, engine: EngineDep, user: CurrentUser):
    return job_object(engine, _run(engine, user, job_id))


@router.post("/fine_tuning/jobs/{job_id}/cancel")
def cancel_job(job_id: str, engine: EngineDep, user: CurrentUser):
    run = _run(engine, user, job_id)
    try:
        runs_uc.cancel_run(engine, user, run.id, if_running=True)
    except StudioError as exc:
        if exc.kind != "conflict":
            raise
        raise ApiError(400, exc.message, "fine_tuning_job_id", "job_already_finished") from None
    return job_object(engine, run)


def _all_events(engine, job_id: int, before: int | None) -> list:
    out, last = [], 0
    while True:
        batch = events.since(engine, job_id, last, 5000)
        if not batch:
            break
        out.extend(e for e in batch if before is None or e.id < before)
        last = batch[-1].id
        if before is not None and last >= before:
            break
    return out


@router.get("/fine_tuning/jobs/{job_id}/events")
def list_events(job_id: str, engine: EngineDep, user: CurrentUser, after: str | None = None,
                limit: str | None = None):
    run = _run(engine, user, job_id)
    limit = page_limit(limit, 20, 10000)
    before = None
    if after:
        before = events.parse_id(after.removeprefix("ftevent-"))
        if before is None:
            raise ApiError(400, f"after must be an event id such as ftevent-12, not {after!r}", "after",
                           "invalid_value")
    evs = _all_events(engine, run.job_id, before) if run.job_id is not None else []
    evs.reverse()  # newest first, as OpenAI lists them
    page = evs[:limit]
    return {"object": "list", "data": [event_object(e) for e in page], "has_more": len(evs) > limit}


def _checkpoint_metrics(folder: Path, step: int) -> dict[str, Any]:
    """The trainer's logged metrics at ``step`` from the checkpoint's trainer_state.json."""
    try:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for entry in state.get("log_history") or []:
        if isinstance(entry, dict) and entry.get("step") == step:
            out.update(entry)
    metrics = {"step": step}
    if "loss" in out:
        metrics["train_loss"] = out["loss"]
    for key in ("learning_rate", "grad_norm", "epoch"):
        if key in out:
            metrics[key] = out[key]
    if "eval_loss" in out:  # the held-out loss at this step, in OpenAI's names
        metrics["valid_loss"] = metrics["full_valid_loss"] = out["eval_loss"]
    return metrics


def run_checkpoints(settings, run: Run) -> list[dict[str, Any]]:
    """The trainer checkpoints the worker left in ``<run dir>/checkpoints/checkpoint-<step>``,
    newest (highest step) first, as ``fine_tuning.job.checkpoint`` objects (without the model)."""
    run_dir = Path(run.output_dir) if run.output_dir else settings.data_dir / "runs" / run.id
    root = run_dir / "checkpoints"
    if not is_under(root, settings.data_dir) or not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        m = re.fullmatch(r"checkpoint-(\d+)", folder.name)
        if m and folder.is_dir():
            found.append((int(m.group(1)), folder))
    out = []
    for step, folder in sorted(found, reverse=True):
        out.append({"id": f"ftckpt-{run.id.removeprefix('ftjob-')}-{step}",
                    "object": "fine_tuning.job.checkpoint",
                    "created_at": int(folder.stat().st_mtime), "fine_tuning_job_id": run.id,
                    "step_number": step, "metrics": _checkpoint_metrics(folder, step)})
    return out


@router.get("/fine_tuning/jobs/{job_id}/checkpoints")
def list_checkpoints(job_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser,
                     after: str | None = None, limit: str | None = None):
    run = _run(engine, user, job_id)
    limit = page_limit(limit, 10, 100)
    model_name = job_object(engine, run)["model"]
    items = run_checkpoints(settings, run)
    items = after_cursor(items, [c["id"] for c in items], after, "checkpoint")
    page = items[:limit]
    for c in page:
        c["fine_tuned_model_checkpoint"] = (fine_tuned_model_id(model_name, run.id)
                                            + f":ckpt-step-{c['step_number']}")
    return {"object": "list", "data": page, "has_more": len(items) > len(page),
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}
