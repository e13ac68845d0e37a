"""GRPO runs from the browser: the run form and prompt-dataset uploads.

The rules live in :mod:`app.studio.grpo`; the JSON API is in :mod:`app.web.api.runs`, the OpenAI
reinforcement method in :mod:`app.web.openai.reinforcement`.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse
from starlette.concurrency import run_in_threadpool

from app.store.specs import (ALL_LINEAR, CUSTOM_REWARD_SIGNATURE, GRPO_LOSS_TYPES, REWARD_DESCRIPTIONS,
                             REWARD_NAMES, SCALE_REWARDS, SCHEDULERS, GrpoSpec)
from app.studio import clone as clone_uc
from app.studio import datasets as datasets_uc
from app.studio.errors import StudioError
from app.studio.grpo import create_grpo_run, custom_rewards_allowed, default_rewards
from app.web.deps import CurrentUser, EngineDep, SettingsDep, current_user, get_engine
from app.web.render import render
from app.web.uploads import UploadError, receive_upload
from app.web import views
from app.web.views import dataset_labeller, grpo_datasets, redirect_to_run

router = APIRouter()

BUILTIN_FORM = [n for n in REWARD_NAMES if n != "custom"]
_INT = {"r", "lora_alpha", "max_steps", "per_device_train_batch_size", "num_generations",
        "gradient_accumulation_steps", "seed", "max_prompt_length", "max_completion_length",
        "num_iterations", "num_gpus"}
_TEXT = ("prompt_column", "answer_column", "system_prompt", "chat_template", "loss_type",
         "scale_rewards", "lr_scheduler_type", "validation_file")
_NUM = _INT | {"learning_rate", "beta", "epsilon", "temperature", "top_p", "lora_dropout",
               "validation_split_percentage", "reward_eval_samples"}
CUSTOM_EXAMPLE = ("def reward(prompt: str, completion: str, item: dict) -> float:\n"
                  "    # item holds the dataset row, e.g. item['answer']\n"
                  "    return 1.0 if item['answer'].split('####')[-1].strip() in completion "
                  "else 0.0\n")


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


def _form_ctx(request, values, errors=None, general=None, fresh=False) -> dict[str, Any]:
    """The form's context; ``fresh`` (a new form, not a re-shown one): the rewards ticked are
    the chosen dataset's defaults (:func:`app.studio.grpo.default_rewards`)."""
    engine, user = get_engine(request), current_user(request)
    models = datasets_uc.usable_models(engine, user)
    datasets = grpo_datasets([d for d in datasets_uc.pickable_datasets(engine, user)
                              if d.status == "processed"], values.get("dataset"))
    if not values.get("model") and models:
        values["model"] = ([m for m in models if m.status == "ready"] or models)[0].id
    if not values.get("dataset") and datasets:
        values["dataset"] = datasets[0].id
    if fresh:
        values["rewards_on"] = default_rewards(next(
            (d for d in datasets if d.id == values.get("dataset")), None))
    return {"values": values, "errors": errors or {}, "general_errors": views.form_notices(user, general),
            "models": models, "datasets": datasets,
            "dataset_label": dataset_labeller(engine, user),
            "all_modules": ALL_LINEAR,
            "schedulers": SCHEDULERS, "loss_types": GRPO_LOSS_TYPES, "scales": SCALE_REWARDS,
            "builtins": BUILTIN_FORM, "descriptions": REWARD_DESCRIPTIONS,
            "signature": CUSTOM_REWARD_SIGNATURE,
            "custom_allowed": custom_rewards_allowed(user),
            "kept": views.kept_fields(values, GrpoSpec, "run_grpo_new.html"),
            "clone_of": values.get("clone_of"), "clone_deleted": values.get("clone_deleted")}


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
    for key in set(GrpoSpec.model_fields) - set(raw) - {"rewards", "target_modules"}:
        v = form.get(key)  # a clone's settings the form does not show (hidden inputs)
        if v is not None and str(v).strip():
            values[key] = raw[key] = str(v).strip()
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


def clone_values(clone) -> dict[str, Any]:
    """The GRPO form's values from a cloned run's settings (:mod:`app.studio.clone`): its spec,
    its rewards as the form's checkboxes, weights and reward parameters."""
    values = views.clone_values(clone, _defaults())
    rewards = values.pop("rewards", None) or []
    values["rewards_on"] = [r["name"] for r in rewards]
    values["weights"] = {**values["weights"], **{r["name"]: r.get("weight", 1.0) for r in rewards}}
    for r in rewards:
        p = r.get("params") or {}
        if r["name"] == "regex_match":
            values.update(regex_pattern=p.get("pattern", ""), regex_column=p.get("column", ""))
        elif r["name"] == "exact_match":
            values["exact_column"] = p.get("column", "")
        elif r["name"] == "text_similarity":
            values["similarity_column"] = p.get("column", "")
        elif r["name"] == "length_penalty" and p.get("target_tokens"):
            values["target_tokens"] = p["target_tokens"]
        elif r["name"] == "custom":
            values["custom_source"] = p.get("source", "")
    for key in ("prompt_column", "answer_column", "system_prompt", "chat_template"):
        values[key] = values.get(key) or ""
    return {**values, "clone_of": clone.run_id}


@router.get("/runs/new/grpo")
def new_grpo_run(request: Request, engine: EngineDep, user: CurrentUser,
                 dataset: str | None = None, model: str | None = None,
                 clone: str | None = None):
    """The GRPO form, pre-filled from the query, or with ``clone`` from a GRPO run's settings
    (an SFT run's open the SFT form)."""
    if clone:
        c = clone_uc.clone_run(engine, user, clone)
        if c.kind != "grpo":
            return RedirectResponse(c.form_url, status_code=303)
        values = clone_values(c)
    else:
        values = _defaults()
        values.update(dataset=dataset or "", model=model or "")
    return render(request, "run_grpo_new.html", _form_ctx(request, values, fresh=not clone),
                  block="grpo_form")


@router.post("/runs/new/grpo/estimate")
async def grpo_estimate_fragment(request: Request, engine: EngineDep, settings: SettingsDep,
                                 user: CurrentUser):
    """The GRPO form's GPU memory estimate (htmx fragment) from the form's current values."""
    return await views.estimate_fragment(request, engine, settings, user, "grpo")


@router.post("/runs/grpo")
async def create_grpo_form(request: Request, engine: EngineDep, settings: SettingsDep,
                           user: CurrentUser):
    form = await request.form()
    raw, values = spec_from_form(form)
    errors: dict[str, str] = {}
    if not raw.get("rewards"):
        errors["rewards"] = "choose at least one reward function"
    run, errors, general = await views.create_from_form(
        GrpoSpec, raw, errors,
        lambda spec: create_grpo_run(engine, settings, user, spec, values.get("name") or None),
        lambda field: "rewards" if field.startswith("rewards") else field,
        name=values.get("name") or None)
    if run is None:
        return render(request, "run_grpo_new.html", _form_ctx(request, values, errors, general),
                      block="grpo_form", status_code=422)
    return redirect_to_run(request, run)


@router.post("/grpo/datasets")
async def upload_prompts_form(request: Request, engine: EngineDep, settings: SettingsDep,
                              user: CurrentUser):
    """The GRPO form's prompt-dataset upload; on to the dataset's page (validating, then its
    prompts with a link back to the form with the dataset chosen)."""
    fields: dict[str, str] = {}
    try:
        up = await receive_upload(request, settings.data_dir / "uploads", settings.max_upload_mb)
        fields = dict(up.fields)
        ds = await run_in_threadpool(
            datasets_uc.record_prompt_upload, engine, settings, user, up.take(),
            up.filename or "prompts.jsonl", up.bytes, fields.get("prompt_column"),
            fields.get("answer_column"))
    except (UploadError, StudioError) as exc:
        if isinstance(exc, StudioError) and exc.kind != "invalid":
            raise
        values = _defaults()
        values.update(upload_prompt_column=str(fields.get("prompt_column") or ""),
                      upload_answer_column=str(fields.get("answer_column") or ""))
        return render(request, "run_grpo_new.html",
                      _form_ctx(request, values, {"upload": exc.message}), status_code=422)
    # validated in the background: its page shows the progress, then links to this form
    return RedirectResponse(f"/datasets/{ds.id}", status_code=303)
