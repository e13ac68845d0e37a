"""The OpenAI fine-tuning API under /v1, so the official ``openai`` client can drive the studio.

Files are datasets (``file-…``, see :mod:`app.web.routes.openai_files`); fine-tuning jobs are runs (``ftjob-…``). Our own TrainSpec
fields (``r``, ``lora_alpha``, ``max_steps``, ``target_modules``, …) are accepted as extra body
fields; ``hyperparameters`` n_epochs / batch_size / learning_rate_multiplier map onto
num_train_epochs / per_device_train_batch_size / learning_rate (× the default 2e-4). Errors use
the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from app.store import events, queue, repo
from app.store.schema import JobState, Run
from app.store.specs import TrainSpec
from app.web.deps import get_engine, get_settings
from app.web.errors import ApiError
from app.web.reinforcement import (create_reinforcement_job, reinforcement_hyperparameters,
                                   reinforcement_method)
from app.web.routes.openai_models import ORGANIZATION, fine_tuned_model_id
from app.web.routes.runs import FieldError, create_checked
from app.web.services import is_under

router = APIRouter(prefix="/v1")
BASE_LR = TrainSpec.model_fields["learning_rate"].default
_IGNORED = {"integrations", "metadata", "suffix", "seed", "validation_file", "hyperparameters",
            "method", "model", "training_file"}


def _status(job) -> str:
    if job is None:
        return "queued"
    return {"queued": "queued", "running": "running", "succeeded": "succeeded",
            "failed": "failed", "cancelled": "cancelled"}.get(job.state, job.state)


def _int_if_whole(x):
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _trained_tokens(job) -> int | None:
    """Tokens the finished job trained on (the worker's ``trained_tokens``, else ``tokens``)."""
    if job is None or job.state != JobState.SUCCEEDED:
        return None
    result = job.result or {}
    value = result.get("trained_tokens", result.get("tokens"))
    return int(value) if isinstance(value, (int, float)) else None


def job_object(engine, run: Run, job=None, model_name: str | None = None) -> dict[str, Any]:
    if job is None and run.job_id is not None:
        job = queue.get_job(engine, run.job_id)
    if model_name is None:
        try:
            model_name = repo.get_model(engine, run.model_id).name
        except repo.NotFound:
            model_name = run.model_id
    spec = run.spec or {}
    status = _status(job)
    if run.kind == "grpo":
        hp = reinforcement_hyperparameters(spec)
    else:
        hp = {"n_epochs": _int_if_whole(spec.get("num_train_epochs")),
              "batch_size": spec.get("per_device_train_batch_size"),
              "learning_rate_multiplier": round(spec.get("learning_rate", BASE_LR) / BASE_LR, 10)}
    error = None
    if job is not None and job.state == JobState.FAILED:
        error = {"code": "training_failed", "message": job.error or "the job failed", "param": None}
    arts = repo.list_artifacts(engine, run.id) if status == "succeeded" else []
    metric = events.latest(engine, job.id, "metric") if job is not None else None
    return {
        "id": run.id, "object": "fine_tuning.job", "created_at": int(run.created_at),
        "error": error,
        "fine_tuned_model": (fine_tuned_model_id(model_name, run.id)
                             if status == "succeeded" else None),
        "finished_at": int(job.finished_at) if job is not None and job.finished_at else None,
        "hyperparameters": hp, "model": model_name, "organization_id": ORGANIZATION,
        "result_files": [a.id for a in arts if a.kind in ("adapter", "config", "metrics")],
        "seed": spec.get("seed"), "status": status,
        "trained_tokens": _trained_tokens(job),
        "training_file": run.dataset_id, "validation_file": None, "integrations": [],
        "metadata": None, "estimated_finish": None, "user_provided_suffix": run.name,
        "method": reinforcement_method(spec) if run.kind == "grpo"
        else {"type": "supervised", "supervised": {"hyperparameters": hp}},
        "whetstone": {"spec": spec, "progress": metric.data if metric else None,
                      "cancel_requested": bool(job and job.cancel_requested)},
    }


def spec_from_openai(body: dict[str, Any]) -> dict[str, Any]:
    """TrainSpec input from an OpenAI job-create body (hyperparameters + our extra fields)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key in ("model", "training_file"):
        if not body.get(key) or not isinstance(body.get(key), str):
            raise ApiError(400, f"{key} is required", key, "missing_required_parameter")
    if body.get("validation_file"):
        raise ApiError(400, "validation_file is not supported yet; leave it out", "validation_file",
                       "unsupported_parameter")
    hp: dict[str, Any] = dict(body.get("hyperparameters") or {})
    method = body.get("method")
    if method:
        if not isinstance(method, dict) or method.get("type", "supervised") != "supervised":
            raise ApiError(400, "method.type must be 'supervised' or 'reinforcement'", "method.type",
                           "unsupported_parameter")
        hp.update((method.get("supervised") or {}).get("hyperparameters") or {})
    raw: dict[str, Any] = {"model": body["model"], "dataset": body["training_file"]}
    mapping = {"n_epochs": "num_train_epochs", "batch_size": "per_device_train_batch_size"}
    for key, value in hp.items():
        if value in (None, "auto"):
            continue
        if key in mapping:
            raw[mapping[key]] = value
        elif key == "learning_rate_multiplier":
            try:
                raw["learning_rate"] = float(value) * BASE_LR
            except (TypeError, ValueError):
                raise ApiError(400, "learning_rate_multiplier must be a number",
                               "hyperparameters.learning_rate_multiplier", "invalid_value") from None
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
    return raw


_PARAM_NAMES = {"num_train_epochs": "hyperparameters.n_epochs",
                "per_device_train_batch_size": "hyperparameters.batch_size",
                "learning_rate": "hyperparameters.learning_rate_multiplier",
                "model": "model", "dataset": "training_file"}


@router.post("/fine_tuning/jobs")
async def create_job(request: Request):
    engine = get_engine(request)
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None
    suffix = body.get("suffix") if isinstance(body, dict) else None
    if suffix is not None and (not isinstance(suffix, str) or len(suffix) > 64):
        raise ApiError(400, "suffix: a string of at most 64 characters", "suffix",
                       "invalid_value")
    if isinstance(body, dict) and isinstance(body.get("method"), dict) \
            and body["method"].get("type") == "reinforcement":
        return create_reinforcement_job(request, body)
    raw = spec_from_openai(body)
    try:
        spec = TrainSpec(**raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else None
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        param = _PARAM_NAMES.get(field, field)
        raise ApiError(400, f"{param}: {msg}" if param else msg, param, "invalid_value") from None
    try:
        run, job = create_checked(engine, get_settings(request), spec, name=body.get("suffix"))
    except FieldError as exc:
        param = _PARAM_NAMES.get(exc.field, exc.field)
        missing = "no " in exc.message[:3]
        code = {"model": "model_not_found", "dataset": "file_not_found" if missing
                else "invalid_file"}.get(exc.field, "invalid_value")
        raise ApiError(404 if missing else 400, exc.message, param, code) from None
    return job_object(engine, run, job)


def _run(request: Request, job_id: str) -> Run:
    try:
        return repo.get_run(get_engine(request), job_id)
    except repo.NotFound:
        raise ApiError(404, f"No fine-tuning job with id {job_id!r}", "fine_tuning_job_id",
                       "fine_tuning_job_not_found") from None


@router.get("/fine_tuning/jobs")
def list_jobs(request: Request, after: str | None = None, limit: int = 20):
    engine = get_engine(request)
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be between 1 and 100, not {limit}", "limit", "invalid_value")
    runs = repo.list_runs(engine, limit=limit + 1, after=after)
    page = runs[:limit]
    return {"object": "list", "data": [job_object(engine, r) for r in page],
            "has_more": len(runs) > limit}


@router.get("/fine_tuning/jobs/{job_id}")
def retrieve_job(request: Request, job_id: str):
    return job_object(get_engine(request), _run(request, job_id))


@router.post("/fine_tuning/jobs/{job_id}/cancel")
def cancel_job(request: Request, job_id: str):
    engine = get_engine(request)
    run = _run(request, job_id)
    if run.job_id is not None:
        job = queue.get_job(engine, run.job_id)
        if job.state in JobState.FINAL:
            raise ApiError(400, f"fine-tuning job {job_id} is already {job.state}", "fine_tuning_job_id",
                           "job_already_finished")
        queue.cancel(engine, run.job_id)
    return job_object(engine, run)


def event_object(ev) -> dict[str, Any]:
    d = ev.data or {}
    level, etype, data = "info", "message", None
    if ev.type == "metric":
        etype = "metrics"
        data = {**d, "step": d.get("step"), "loss": d.get("loss"), "train_loss": d.get("loss"),
                "learning_rate": d.get("learning_rate"), "total_steps": d.get("total_steps")}
        total = f"/{d['total_steps']}" if d.get("total_steps") else ""
        loss = f"{d['loss']:.4f}" if isinstance(d.get("loss"), (int, float)) else "n/a"
        message = f"Step {d.get('step')}{total}: training loss={loss}"
        if isinstance(d.get("reward"), (int, float)):
            message += f", mean reward={d['reward']:.4g}"
    elif ev.type == "state":
        state = d.get("state")
        message = {"queued": "Fine-tuning job queued", "running": "Fine-tuning job started",
                   "succeeded": "The job has successfully completed",
                   "cancelled": "Fine-tuning job cancelled",
                   "failed": "Fine-tuning job failed"}.get(state, f"Job state: {state}")
        extra = d.get("error") or d.get("reason")
        if extra:
            message += f": {extra}"
        if state == "failed":
            level = "error"
        data = d
    elif ev.type == "log":
        level = d.get("level", "info")
        level = "warn" if level == "warning" else level
        message = d.get("message", "")
    elif ev.type == "sample":
        message, data = sample_message(d), d
    else:
        message = d.get("message") or f"{d.get('stage', ev.type)}: {d.get('done', '')}/{d.get('total', '')}"
        data = d
    return {"id": f"ftevent-{ev.id}", "object": "fine_tuning.job.event", "created_at": int(ev.ts),
            "level": level, "message": message, "type": etype, "data": data}


def sample_message(d: dict[str, Any]) -> str:
    """A GRPO ``sample`` event in one line: step, the first completion's reward and its start
    (the rows themselves are in ``data`` and the run page's samples table)."""
    rows = [r for r in d.get("rows") or [] if isinstance(r, dict)]
    head = f"sample: step {d['step']}" if d.get("step") is not None else "sample"
    if not rows:
        return head
    first = rows[0]
    reward = first.get("reward")
    text = " ".join(str(first.get("completion") or "").split())
    text = text[:60] + ("…" if len(text) > 60 else "")
    score = f"reward {reward:.4g}" if isinstance(reward, (int, float)) else "reward n/a"
    more = f" (+{len(rows) - 1} more)" if len(rows) > 1 else ""
    return f"{head}, {score} — {text or '(empty completion)'}{more}"


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
def list_events(request: Request, job_id: str, after: str | None = None, limit: int = 20):
    engine = get_engine(request)
    run = _run(request, job_id)
    limit = max(1, min(limit, 10000))
    before = None
    if after:
        try:
            before = int(after.removeprefix("ftevent-"))
        except ValueError:
            raise ApiError(400, f"after must be an event id such as ftevent-12, not {after!r}", "after",
                           "invalid_value") from None
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
def list_checkpoints(request: Request, job_id: str, after: str | None = None, limit: int = 10):
    engine = get_engine(request)
    run = _run(request, job_id)
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be between 1 and 100, not {limit}", "limit", "invalid_value")
    model_name = job_object(engine, run)["model"]
    items = run_checkpoints(get_settings(request), run)
    if after:
        ids = [c["id"] for c in items]
        items = items[ids.index(after) + 1:] if after in ids else items
    page = items[:limit]
    for c in page:
        c["fine_tuned_model_checkpoint"] = (fine_tuned_model_id(model_name, run.id)
                                            + f":ckpt-step-{c['step_number']}")
    return {"object": "list", "data": page, "has_more": len(items) > len(page),
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}
