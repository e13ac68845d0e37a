"""The OpenAI object shapes the /v1 surface answers with: fine-tuning jobs, their events,
files and models (no routes here, so the /v1 route modules never import each other).

A run is a ``fine_tuning.job`` (``ftjob-…``); a dataset a ``file`` (``file-…``); a job's result
files are artifacts (``art-…``); a fine-tuned model's id is ``<base model name>:ft:<job id>``.
Times are integer UNIX seconds, as OpenAI sends them.
"""
from __future__ import annotations

import json
import os
from typing import Any

from app.store import events, queue, repo
from app.store.schema import Artifact, Dataset, JobState, Run
from app.store.specs import GrpoSpec, TrainSpec
from app.studio import artifacts, epochs
from app.studio import runs as runs_uc

#: ``organization_id`` of every fine-tuning job, and ``owned_by`` of its fine-tuned model.
ORGANIZATION = "whetstone"


def model_object(model_id: str, created: float, owned_by: str) -> dict[str, Any]:
    """``{"id", "object": "model", "created", "owned_by"}``."""
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": owned_by}


def fine_tuned_model_id(model_name: str, run_id: str) -> str:
    """The id of the model a succeeded run produced, e.g. ``stories260K:ft:ftjob-3f9a…``."""
    return f"{model_name}:ft:{run_id}"


def _status(job) -> str:
    return "queued" if job is None else job.state


def _trained_tokens(job) -> int | None:
    """Tokens the finished job trained on (the worker's ``trained_tokens``, else ``tokens``)."""
    if job is None or job.state != JobState.SUCCEEDED:
        return None
    result = job.result or {}
    value = result.get("trained_tokens", result.get("tokens"))
    return int(value) if isinstance(value, (int, float)) else None


def job_object(engine, run: Run, job=None, model_name: str | None = None) -> dict[str, Any]:
    """A run as an OpenAI ``fine_tuning.job`` (with our spec and progress under ``whetstone``)."""
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
        hp = {"n_epochs": epochs.n_epochs(engine, run, job),
              "batch_size": spec.get("per_device_train_batch_size"),
              "learning_rate_multiplier": runs_uc.multiplier_of_learning_rate(TrainSpec, spec)}
    error = None
    if job is not None and job.state == JobState.FAILED:
        error = {"code": "training_failed", "message": job.error or "the job failed", "param": None}
    arts = artifacts.present(engine, run.id) if status == "succeeded" else []
    metric = events.latest(engine, job.id, "metric") if job is not None else None
    return {
        "id": run.id, "object": "fine_tuning.job", "created_at": int(run.created_at),
        "error": error,
        "fine_tuned_model": (fine_tuned_model_id(model_name, run.id)
                             if status == "succeeded" else None),
        "finished_at": int(job.finished_at) if job is not None and job.finished_at else None,
        "hyperparameters": hp, "model": model_name, "organization_id": ORGANIZATION,
        "result_files": [a.id for a in arts if a.kind in ("adapter", "config", "metrics", "eval")],
        "seed": spec.get("seed"), "status": status,
        "trained_tokens": _trained_tokens(job),
        "training_file": run.dataset_id, "validation_file": spec.get("validation_file"),
        "integrations": [],
        "metadata": None, "estimated_finish": None, "user_provided_suffix": run.name,
        "method": reinforcement_method(spec) if run.kind == "grpo"
        else {"type": "supervised", "supervised": {"hyperparameters": hp}},
        "whetstone": {"spec": spec, "progress": metric.data if metric else None,
                      "cancel_requested": bool(job and job.cancel_requested)},
    }


def reinforcement_hyperparameters(spec: dict[str, Any]) -> dict[str, Any]:
    """A GRPO run's OpenAI ``hyperparameters``: the learning-rate multiplier is relative to the
    GRPO default learning rate (as when the job was created); ``n_epochs`` as sent, if any."""
    return {"batch_size": spec.get("per_device_train_batch_size"),
            "learning_rate_multiplier": runs_uc.multiplier_of_learning_rate(GrpoSpec, spec),
            "n_epochs": spec.get("n_epochs")}


def reinforcement_method(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``method`` of a GRPO run's OpenAI job object: the grader the job was created with
    (None for runs made with our own rewards) and the rewards it was mapped onto."""
    return {"type": "reinforcement",
            "reinforcement": {"hyperparameters": reinforcement_hyperparameters(spec),
                              "grader": spec.get("grader"),
                              "whetstone_rewards": json.loads(json.dumps(spec.get("rewards", [])))}}


def event_object(ev) -> dict[str, Any]:
    """A job event as an OpenAI ``fine_tuning.job.event`` (metric events carry ``step`` and
    ``train_loss`` in ``data``; an evaluation's carry ``eval_loss``, also as OpenAI's
    ``valid_loss`` and ``full_valid_loss``; the best evaluation's ``best_step``)."""
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
        if isinstance(d.get("eval_loss"), (int, float)):
            data.update(valid_loss=d["eval_loss"], full_valid_loss=d["eval_loss"])
            message = f"Step {d.get('step')}{total}: eval loss={d['eval_loss']:.4f}"
        elif "best_step" in d or "early_stopped" in d:
            message = eval_end_message(d)
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


def eval_end_message(d: dict[str, Any]) -> str:
    """The metric event sent when an evaluating run's training ended, in one line: the best
    checkpoint and its eval loss, and whether early stopping ended it."""
    parts = []
    if isinstance(d.get("best_eval_loss"), (int, float)):
        parts.append(f"Best checkpoint: {d.get('best_checkpoint')} (step {d.get('best_step')}), "
                     f"eval loss={d['best_eval_loss']:.4f}")
    if d.get("early_stopped"):
        parts.append(f"stopped early at step {d.get('step')}")
    return "; ".join(parts) or f"Evaluation ended at step {d.get('step')}"


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


def file_object(ds: Dataset) -> dict[str, Any]:
    """A dataset as an OpenAI ``file`` object: ``status`` is ``uploaded`` while it is validated
    in the background (``status_details`` says how far), then ``processed`` or ``error``."""
    status, details = ds.status, ds.error
    if status == "validating":
        status, details = "uploaded", ((ds.report or {}).get("validating") or {}) and \
            f"validating: {(ds.report['validating'].get('done') or 0):,} rows read"
    return {"id": ds.id, "object": "file", "bytes": ds.bytes, "created_at": int(ds.created_at),
            "filename": ds.filename, "purpose": ds.purpose, "status": status,
            "status_details": details or None, "expires_at": None}


def result_file_object(art: Artifact) -> dict[str, Any]:
    """A job's result file (``result_files`` of a fine-tuning job: the adapter zip, config.json)."""
    return {"id": art.id, "object": "file", "bytes": art.bytes, "created_at": int(art.created_at),
            "filename": os.path.basename(art.path), "purpose": "fine-tune-results",
            "status": "processed", "status_details": None, "expires_at": None}




def chat_completion_object(cid: str, created: float, model: str, text: str,
                           finish_reason: str | None, usage: dict[str, int]) -> dict[str, Any]:
    """A ``chat.completion``: one assistant choice with ``text`` and the token ``usage``
    (``prompt_tokens``, ``completion_tokens``, ``total_tokens``)."""
    return {"id": cid, "object": "chat.completion", "created": int(created), "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                 "refusal": None},
                         "logprobs": None, "finish_reason": finish_reason or "stop"}],
            "usage": usage}


def chat_chunk_object(cid: str, created: float, model: str, delta: dict[str, Any] | None,
                      finish_reason: str | None = None,
                      usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of a stream: a ``delta`` (role, content) and, on the last
    one, its ``finish_reason``; ``delta`` None gives the closing usage chunk (no choices), as
    ``stream_options.include_usage`` asks."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]
    return {"id": cid, "object": "chat.completion.chunk", "created": int(created),
            "model": model, "system_fingerprint": None, "choices": choices, "usage": usage}
