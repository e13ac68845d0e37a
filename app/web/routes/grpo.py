"""GRPO runs from the browser and the native API: the run form, prompt-dataset uploads and
``POST /api/runs/grpo``.

The OpenAI ``method={"type": "reinforcement", ...}`` shape is in :mod:`app.web.reinforcement`,
the mapping of OpenAI graders onto rewards in :mod:`app.web.graders`.
"""
from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse
from pydantic import ValidationError

from starlette.concurrency import run_in_threadpool

from app.data.errors import DatasetError
from app.data.model_config import completion_too_long
from app.data.prompts import inspect_prompts
from app.store import repo
from app.store.schema import Dataset, new_id
from app.store.specs import (ALL_LINEAR, CUSTOM_REWARD_SIGNATURE, GRPO_LOSS_TYPES, REWARD_DESCRIPTIONS,
                             REWARD_NAMES, SCALE_REWARDS, SCHEDULERS, GrpoSpec)
from app.web.deps import get_engine, get_settings
from app.web.errors import ApiError
from app.web.render import render
from app.web.routes.api import invalid_spec, json_object, run_json
from app.web.routes.runs import (FieldError, check_qlora_device, check_targets, redirect_to_run,
                                 usable_dataset, usable_model)
from app.web.services import SUPPORTED, field_errors
from app.web.uploads import UploadError, receive_upload, safe_filename

router = APIRouter()

BUILTIN_FORM = [n for n in REWARD_NAMES if n != "custom"]
_INT = {"r", "lora_alpha", "max_steps", "per_device_train_batch_size", "num_generations",
        "gradient_accumulation_steps", "seed", "max_prompt_length", "max_completion_length",
        "num_iterations"}
_TEXT = ("prompt_column", "answer_column", "system_prompt", "chat_template", "loss_type",
         "scale_rewards", "lr_scheduler_type")
_NUM = _INT | {"learning_rate", "beta", "epsilon", "temperature", "top_p", "lora_dropout"}
CUSTOM_EXAMPLE = ("def reward(prompt: str, completion: str, item: dict) -> float:\n"
                  "    # item holds the dataset row, e.g. item['answer']\n"
                  "    return 1.0 if item['answer'].split('####')[-1].strip() in completion "
                  "else 0.0\n")


def current_user(request: Request) -> str | None:
    """The signed-in user; None until Whetstone has logins."""
    return getattr(request.state, "user", None)


def create_grpo_run(engine, settings, spec: GrpoSpec, name: str | None, owner: str | None):
    """Check permission, model (a completion must fit its context window) and dataset, then
    create the run and queue its ``grpo`` job."""
    if spec.has_custom_rewards and not settings.custom_rewards_allowed(owner):
        raise FieldError("rewards", "custom Python rewards are not allowed for this user; an "
                                    "admin allows them with WHETSTONE_ALLOW_CUSTOM_REWARDS")
    model = usable_model(engine, spec)
    problem = completion_too_long(spec.max_completion_length, model.path, model.name)
    if problem:
        raise FieldError("max_completion_length", problem)
    check_targets(spec, model)
    ds = usable_dataset(engine, spec)
    spec = with_dataset_columns(spec, ds)
    check_columns(spec, ds)
    check_qlora_device(engine, settings, spec)
    return repo.create_run(engine, spec, kind="grpo", name=name, owner=owner)


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

    Raises FieldError (``prompt_column``, ``answer_column`` or ``rewards[i].params.column``)
    naming the reward and listing the dataset's columns.
    """
    cols = dataset_columns(ds)
    if not cols:
        return
    have = f"dataset {ds.filename!r} has columns: {', '.join(cols)}"
    for field in ("prompt_column", "answer_column"):
        col = getattr(spec, field)
        if col and col not in cols:
            raise FieldError(field, f"column {col!r} is not in the dataset ({have})")
    answer = spec.answer_column
    if not answer:
        from app.data.prompts import pick_columns

        try:
            answer = pick_columns(dict.fromkeys(cols), spec.prompt_column)[1]
        except DatasetError as exc:
            raise FieldError("prompt_column", str(exc)) from None
    for i, r in enumerate(spec.rewards):
        col = (r.params or {}).get("column")
        label = r.label or r.name
        if col and col not in cols:
            raise FieldError(f"rewards[{i}].params.column",
                             f"reward {label!r} reads column {col!r}, which is not in the "
                             f"dataset ({have})")
        if not col and r.name in _NEEDS_REFERENCE and not answer:
            raise FieldError(f"rewards[{i}].params.column",
                             f"reward {label!r} needs a reference column: the dataset has no "
                             f"answer column; name one with answer_column or the reward's "
                             f"column ({have})")


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


# ---- the form ---------------------------------------------------------------------------
def _defaults() -> dict[str, Any]:
    vals = {k: f.get_default(call_default_factory=True) for k, f in GrpoSpec.model_fields.items()
            if k not in ("model", "dataset", "rewards")}
    vals.update(model="", dataset="", name="", prompt_column="", answer_column="",
                system_prompt="", chat_template="", rewards_on=["numeric_match", "format"],
                weights={n: 1.0 for n in REWARD_NAMES}, regex_pattern="", regex_column="",
                exact_column="", similarity_column="", target_tokens=200,
                custom_source=CUSTOM_EXAMPLE)
    vals["weights"]["format"] = 0.5
    vals["weights"]["length_penalty"] = 0.1
    return vals


def _form_ctx(request, values, errors=None, general=None) -> dict[str, Any]:
    engine = get_engine(request)
    models = repo.list_models(engine)
    datasets = [d for d in repo.list_datasets(engine) if d.status == "processed"]
    if not values.get("model") and models:
        values["model"] = ([m for m in models if m.status == "ready"] or models)[0].id
    if not values.get("dataset") and datasets:
        values["dataset"] = datasets[0].id
    return {"values": values, "errors": errors or {}, "general_errors": general or [],
            "models": models, "datasets": datasets, "all_modules": ALL_LINEAR,
            "schedulers": SCHEDULERS, "loss_types": GRPO_LOSS_TYPES, "scales": SCALE_REWARDS,
            "builtins": BUILTIN_FORM, "descriptions": REWARD_DESCRIPTIONS,
            "signature": CUSTOM_REWARD_SIGNATURE,
            "custom_allowed": get_settings(request).custom_rewards_allowed(current_user(request))}


def spec_from_form(form) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw GrpoSpec input, values to re-show) from the submitted form."""
    values = _defaults()
    raw: dict[str, Any] = {}
    for key in ("model", "dataset", "name", *_TEXT, *_NUM, "regex_pattern", "regex_column",
                "exact_column", "similarity_column", "target_tokens", "custom_source"):
        v = form.get(key)
        if v is not None:
            values[key] = str(v) if key == "custom_source" else str(v).strip()
    for key in ("model", "dataset", *_TEXT, *_NUM):
        if values.get(key) not in ("", None) and key in GrpoSpec.model_fields:
            raw[key] = values[key]
    values["load_in_4bit"] = raw["load_in_4bit"] = form.get("load_in_4bit") in ("true", "on", "1")
    values["target_modules"] = raw["target_modules"] = [str(m) for m in form.getlist("target_modules")]
    values["rewards_on"] = [str(n) for n in form.getlist("rewards")]
    rewards = []
    for name in values["rewards_on"]:
        w = str(form.get(f"weight_{name}") or "1").strip()
        values["weights"][name] = w
        params: dict[str, Any] = {}
        if name == "regex_match":
            params["pattern"] = values["regex_pattern"]
            if values["regex_column"]:
                params["column"] = values["regex_column"]
        elif name == "exact_match" and values["exact_column"]:
            params["column"] = values["exact_column"]
        elif name == "text_similarity" and values["similarity_column"]:
            params["column"] = values["similarity_column"]
        elif name == "length_penalty":
            params["target_tokens"] = _int(values["target_tokens"])
        elif name == "custom":
            params = {"source": values["custom_source"]}
        rewards.append({"name": name, "weight": w, "params": params})
    raw["rewards"] = rewards
    return raw, values


def _int(v):
    try:
        return int(str(v))
    except ValueError:
        return v


@router.get("/runs/new/grpo")
def new_grpo_run(request: Request, dataset: str | None = None, model: str | None = None):
    values = _defaults()
    values.update(dataset=dataset or "", model=model or "")
    return render(request, "run_grpo_new.html", _form_ctx(request, values), block="grpo_form")


@router.post("/runs/grpo")
async def create_grpo_form(request: Request):
    form = await request.form()
    raw, values = spec_from_form(form)
    errors: dict[str, str] = {}
    general: list[str] = []
    spec = None
    try:
        spec = GrpoSpec(**raw)
    except ValidationError as exc:
        errors, general = field_errors(exc)
    if not raw.get("rewards"):
        errors["rewards"] = "choose at least one reward function"
    run = None
    if spec is not None and not errors:
        try:
            run, _ = create_grpo_run(get_engine(request), get_settings(request), spec,
                                     values.get("name") or None, current_user(request))
        except FieldError as exc:
            errors["rewards" if exc.field.startswith("rewards") else exc.field] = exc.message
    if run is None:
        return render(request, "run_grpo_new.html", _form_ctx(request, values, errors, general),
                      block="grpo_form", status_code=422)
    return redirect_to_run(request, run)


# ---- prompt datasets (GSM8K-style rows are no SFT format) --------------------------------
async def upload_prompts(request: Request) -> Dataset:
    """Receive a multipart upload and record it as a GRPO prompt dataset.

    Raises UploadError (transport) or DatasetError (no readable row, no prompt column).
    """
    settings = get_settings(request)
    up = await receive_upload(request, settings.data_dir / "uploads", settings.max_upload_mb)
    request.state.upload_fields = dict(up.fields)
    original = up.filename or "prompts.jsonl"
    if os.path.splitext(original)[1].lower() not in SUPPORTED:
        up.discard()
        raise DatasetError(f"unsupported file type; use one of {', '.join(SUPPORTED)}")
    ds_id = new_id("file")
    final = settings.data_dir / "uploads" / f"{ds_id}-{safe_filename(original)}"
    os.replace(up.temp_path, final)
    up.temp_path = None
    try:
        report = await run_in_threadpool(
            inspect_prompts, str(final), up.fields.get("prompt_column") or None,
            up.fields.get("answer_column") or None)
    except Exception:
        final.unlink(missing_ok=True)
        raise
    ds = Dataset(id=ds_id, filename=original, path=str(final.resolve()), bytes=up.bytes,
                 format="prompts", rows=report["valid_rows"], purpose="grpo",
                 status="processed", report=report)
    return repo.add_dataset(get_engine(request), ds)


@router.post("/grpo/datasets")
async def upload_prompts_form(request: Request):
    try:
        ds = await upload_prompts(request)
    except (UploadError, DatasetError) as exc:
        values = _defaults()
        sent = getattr(request.state, "upload_fields", {}) or {}
        values.update(upload_prompt_column=str(sent.get("prompt_column") or ""),
                      upload_answer_column=str(sent.get("answer_column") or ""))
        return render(request, "run_grpo_new.html",
                      _form_ctx(request, values, {"upload": str(getattr(exc, "message", exc))}),
                      status_code=422)
    return RedirectResponse(f"/runs/new/grpo?dataset={ds.id}", status_code=303)


@router.post("/api/grpo/datasets", status_code=201)
async def upload_prompts_api(request: Request):
    try:
        ds = await upload_prompts(request)
    except UploadError as exc:
        raise ApiError(exc.status, str(exc), exc.param) from None
    except DatasetError as exc:
        raise ApiError(422, str(exc), "file", "invalid_file") from None
    return {"id": ds.id, "filename": ds.filename, "rows": ds.rows, "format": ds.format,
            "purpose": ds.purpose, "report": ds.report}


# ---- JSON API ---------------------------------------------------------------------------
@router.post("/api/runs/grpo", status_code=201)
async def create_grpo_api(request: Request):
    body = await json_object(request, "a JSON object (a GrpoSpec)")
    name = body.pop("name", None)
    try:
        spec = GrpoSpec(**body)
    except ValidationError as exc:
        return invalid_spec(exc)
    engine = get_engine(request)
    try:
        run, _ = create_grpo_run(engine, get_settings(request), spec, name, current_user(request))
    except FieldError as exc:
        status = 403 if exc.field == "rewards" else 404 if exc.field in ("model", "dataset") \
            and exc.message.startswith("no ") else 422
        raise ApiError(status, exc.message, exc.field) from None
    return run_json(engine, run, full=True)


@router.get("/api/grpo/rewards")
def reward_catalog(request: Request):
    """The reward functions a run may use, the custom signature, and whether custom is allowed."""
    return {"rewards": [{"name": n, "description": REWARD_DESCRIPTIONS[n]} for n in REWARD_NAMES],
            "custom_signature": CUSTOM_REWARD_SIGNATURE,
            "custom_allowed": get_settings(request).custom_rewards_allowed(current_user(request))}


# ---- OpenAI reinforcement method ----------------------------------------------------------
