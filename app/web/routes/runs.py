"""Runs: the new-run form, the live run page (SSE), cancel."""
from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from app.data.model_config import missing_targets
from app.store import events, queue, repo
from app.store import workers as workers_store
from app.store.schema import JobState
from app.store.specs import ALL_LINEAR, SCHEDULERS, TrainSpec
from app.web.deps import get_engine, get_settings, is_htmx
from app.web.inspect import default_templates
from app.web.routes.exports import exports_view
from app.web.render import render
from app.web.services import chat_template_problem, default_max_seq_length, field_errors
from app.web.sse import job_event_stream, start_after

router = APIRouter()

_INT = {"r", "lora_alpha", "max_seq_length", "max_steps", "per_device_train_batch_size",
        "gradient_accumulation_steps", "seed"}
_FLOAT = {"lora_dropout", "learning_rate", "num_train_epochs", "warmup_ratio"}
_BOOL = ("train_on_responses_only", "packing", "load_in_4bit")


def _defaults() -> dict:
    spec_fields = TrainSpec.model_fields
    vals = {k: f.get_default(call_default_factory=True) for k, f in spec_fields.items()
            if k not in ("model", "dataset")}
    vals.update(model="", dataset="", name="")
    return vals


def template_ctx(engine, model_ref: str | None, choice: str | None = None,
                 text: str | None = None) -> dict:
    """What the chat-template part of the form shows for the chosen model."""
    model = None
    if model_ref:
        try:
            model = repo.get_model(engine, model_ref)
        except repo.NotFound:
            model = None
    defaults = default_templates()
    names = list(defaults)
    chosen = choice if choice in defaults else names[0]
    return {"model_name": model.name if model else None,
            "model_has_template": bool(model and model.chat_template),
            "names": names, "choice": chosen,
            "text": text if text else defaults[chosen]}


def _form_ctx(engine, values: dict, errors: dict | None = None, general: list | None = None,
              tmpl: dict | None = None) -> dict:
    # a failed model cannot train: it is left out (its reason is on the Models page)
    models = [m for m in repo.list_models(engine) if m.status != "failed"]
    # GRPO prompt datasets have no answers to train on: they are for /runs/new/grpo
    datasets = [d for d in repo.list_datasets(engine)
                if d.status == "processed" and d.format != "prompts"]
    if not values.get("model") and models:
        ready = [m for m in models if m.status == "ready"]
        values["model"] = (ready or models)[0].id
    if not values.get("dataset") and datasets:
        values["dataset"] = datasets[0].id
    return {"values": values, "errors": errors or {}, "general_errors": general or [],
            "models": models, "datasets": datasets, "all_modules": ALL_LINEAR,
            "schedulers": SCHEDULERS,
            "tmpl": tmpl or template_ctx(engine, values.get("model"))}


def _form_max_seq_length(engine, model_ref: str | None) -> int:
    """The form's default length for the model named ``model_ref`` (services.default_max_seq_length)."""
    model = None
    if model_ref:
        try:
            model = repo.get_model(engine, model_ref)
        except repo.NotFound:
            pass
    return default_max_seq_length(model)


@router.get("/runs/new")
def new_run(request: Request, dataset: str | None = None, model: str | None = None,
            chat_template: str | None = None, max_seq_length: str | None = None):
    """The run form, pre-filled from the query (e.g. the dataset page's "Train on this dataset":
    dataset, model, chat_template name and max_seq_length)."""
    engine = get_engine(request)
    values = _defaults()
    values["dataset"] = dataset or ""
    values["model"] = model or ""
    ctx = _form_ctx(engine, values)
    if max_seq_length and max_seq_length.strip().isdigit():
        values["max_seq_length"] = int(max_seq_length)
    else:
        values["max_seq_length"] = _form_max_seq_length(engine, values.get("model"))
    if chat_template:
        ctx["tmpl"] = template_ctx(engine, values.get("model"), chat_template)
    return render(request, "run_new.html", ctx, block="run_form")


@router.get("/runs/new/template")
def template_fragment(request: Request, model: str | None = None,
                      chat_template_choice: str | None = None):
    engine = get_engine(request)
    ctx = _form_ctx(engine, {**_defaults(), "model": model or ""},
                    tmpl=template_ctx(engine, model, chat_template_choice))
    return render(request, "run_new.html", ctx, block="chat_template")


def spec_from_form(form, engine) -> tuple[dict, dict]:
    """(raw TrainSpec input, the values to re-show in the form) from the submitted form."""
    values = _defaults()
    raw: dict = {}
    for key in list(values):
        if key in _BOOL or key == "target_modules":
            continue
        v = form.get(key)
        if v is None:
            continue
        v = str(v).strip()
        values[key] = v
        if v != "" and key in TrainSpec.model_fields:
            raw[key] = v
    for key in _BOOL:
        values[key] = form.get(key) in ("true", "on", "1")
        raw[key] = values[key]
    values["target_modules"] = [str(m) for m in form.getlist("target_modules")]
    raw["target_modules"] = values["target_modules"]
    for key in ("model", "dataset"):
        raw[key] = values.get(key) or ""
    choice = form.get("chat_template_choice")
    text = (form.get("chat_template") or "").strip()
    if choice != "model":
        if not text:
            text = default_templates().get(str(choice or ""), "") or next(iter(default_templates().values()))
        raw["chat_template"] = text
        values["chat_template"] = text
    else:
        raw.pop("chat_template", None)
    return raw, values


@router.post("/runs")
async def create_run(request: Request):
    engine = get_engine(request)
    form = await request.form()
    raw, values = spec_from_form(form, engine)
    name = values.get("name") or None
    raw.pop("name", None)
    errors: dict[str, str] = {}
    general: list[str] = []
    spec = None
    try:
        spec = TrainSpec(**raw)
    except ValidationError as exc:
        errors, general = field_errors(exc)
    if not raw.get("model"):
        errors["model"] = "choose a model (register one on the Models page)"
    if not raw.get("dataset"):
        errors["dataset"] = "choose a dataset (upload one on the Datasets page)"
    run = None
    if spec is not None and not errors:
        try:
            run, _ = create_checked(engine, get_settings(request), spec, name)
        except FieldError as exc:
            errors[exc.field] = exc.message
    if run is None:
        tmpl = template_ctx(engine, values.get("model"), form.get("chat_template_choice"),
                            values.get("chat_template") or None)
        return render(request, "run_new.html", _form_ctx(engine, values, errors, general, tmpl),
                      block="run_form", status_code=422)
    return redirect_to_run(request, run)


class FieldError(Exception):
    """A problem with one field of a run request."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def usable_model(engine, spec):
    """The spec's model row. Raises FieldError("model") when it is unknown or failed to import."""
    try:
        model = repo.get_model(engine, spec.model)
    except repo.NotFound as exc:
        raise FieldError("model", str(exc)) from None
    if model.status == "failed":
        raise FieldError("model", f"model {model.name!r} failed to import: {model.error or 'unknown error'}")
    return model


def check_targets(spec, model) -> None:
    """Raises FieldError("target_modules") when a LoRA target names no module of the model."""
    problem = missing_targets(spec.target_modules, model.path, model.name)
    if problem:
        raise FieldError("target_modules", problem)


def usable_dataset(engine, spec):
    """The spec's dataset row. Raises FieldError("dataset") when it is unknown or unprocessed."""
    try:
        ds = repo.get_dataset(engine, spec.dataset)
    except repo.NotFound as exc:
        raise FieldError("dataset", str(exc)) from None
    if ds.status != "processed":
        raise FieldError("dataset", f"dataset {ds.filename!r} is not usable: {ds.error or ds.status}")
    return ds


def check_qlora_device(engine, settings, spec) -> None:
    """Raises FieldError("load_in_4bit") when the spec asks for QLoRA and every live worker
    runs without CUDA. With no live worker the run is accepted: a GPU worker may start later."""
    if not spec.load_in_4bit:
        return
    live = workers_store.live(engine, settings.worker_stale_seconds)
    if live and not any(workers_store.has_cuda(w) for w in live):
        devices = "; ".join(sorted({w.device for w in live}))
        raise FieldError("load_in_4bit", "QLoRA (load_in_4bit) needs a CUDA GPU, and no live "
                         f"worker has one (workers run on: {devices}). Turn load_in_4bit off "
                         "to train LoRA in full precision, or start a worker on a GPU.")


def create_checked(engine, settings, spec: TrainSpec, name: str | None = None):
    """Check the model and dataset are usable, then create the run and queue its job.

    Raises:
        FieldError: unknown or failed model, LoRA targets the model does not have, unknown or
            unusable dataset (a GRPO prompt dataset is not an SFT one), a chat template
            that does not parse or render a sample conversation, QLoRA when every live
            worker runs without CUDA.
    """
    model = usable_model(engine, spec)
    problem = chat_template_problem(spec.chat_template, model.chat_template)
    if problem:
        raise FieldError("chat_template", problem)
    check_targets(spec, model)
    ds = usable_dataset(engine, spec)
    if ds.format == "prompts":
        why = (ds.report or {}).get("sft_error")
        raise FieldError("dataset", f"dataset {ds.filename!r} is a GRPO prompt dataset (prompts "
                                    f"without responses to train on), not an SFT dataset"
                                    + (f" ({why})" if why else "") + "; start a GRPO run on it "
                                    f"at /runs/new/grpo?dataset={ds.id}")
    check_qlora_device(engine, settings, spec)
    return repo.create_run(engine, spec, name=name)


def redirect_to_run(request: Request, run) -> Response:
    """After a form created a run: go to its page (HX-Redirect for htmx, else 303)."""
    url = f"/runs/{run.id}"
    if is_htmx(request):
        return Response(status_code=200, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


# What the run page lists under "Artifacts"; export files are listed under "Exports".
RUN_ARTIFACT_KINDS = ("adapter", "config", "metrics")


def run_view(engine, run_id: str) -> dict:
    """Everything the run page shows at load time."""
    run, job = repo.run_with_job(engine, run_id)
    metric = events.latest(engine, job.id, "metric") if job else None
    m = metric.data if metric else None
    progress = 0
    if m and m.get("total_steps"):
        progress = min(100, round(100 * m["step"] / max(1, m["total_steps"])))
    state = job.state if job else "unknown"
    if state == JobState.SUCCEEDED:
        progress = 100
    try:
        model_name = repo.get_model(engine, run.model_id).name
    except repo.NotFound:
        model_name = run.model_id
    try:
        dataset_name = repo.get_dataset(engine, run.dataset_id).filename
    except repo.NotFound:
        dataset_name = run.dataset_id
    return {"run": run, "job": job, "state": state, "metric": m, "progress": progress,
            "error": job.error if job else None,
            "cancel_requested": bool(job and job.cancel_requested),
            "artifacts": [a for a in repo.list_artifacts(engine, run.id)
                          if a.kind in RUN_ARTIFACT_KINDS and not (a.meta or {}).get("export_id")],
            "model_name": model_name, "dataset_name": dataset_name,
            "spec_json": json.dumps(run.spec, indent=2), **exports_view(engine, run.id)}


@router.get("/runs/{run_id}")
def run_page(request: Request, run_id: str):
    return render(request, "run.html", run_view(get_engine(request), run_id), block="artifacts")


@router.post("/runs/{run_id}/cancel")
def cancel_run(request: Request, run_id: str):
    engine = get_engine(request)
    run = repo.get_run(engine, run_id)
    if run.job_id is not None:
        queue.cancel(engine, run.job_id)
    if is_htmx(request):
        return render(request, "run.html", run_view(engine, run_id), block="controls")
    return RedirectResponse(f"/runs/{run_id}", status_code=303)


@router.get("/runs/{run_id}/events")
async def run_events(request: Request, run_id: str, after: str | None = None):
    engine = get_engine(request)
    run = repo.get_run(engine, run_id)
    if run.job_id is None:
        return Response(status_code=204)
    start = start_after(request.headers.get("last-event-id"), after)
    return EventSourceResponse(job_event_stream(engine, run.job_id, start), ping=15,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
