"""Runs: the new-run form, the live run page (SSE), cancel, resume, delete."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from sse_starlette.sse import EventSourceResponse

from app.data.chat_template import DEFAULT_TEMPLATES
from app.store.specs import ALL_LINEAR, SCHEDULERS, TrainSpec
from app.studio import access
from app.studio import clone as clone_uc
from app.studio import datasets as datasets_uc
from app.studio import removal
from app.studio import resume as resume_uc
from app.studio import runs as runs_uc
from app.studio import train_time
from app.studio.run_place import run_place
from app.studio.errors import StudioError
from app.web import flash
from app.web.deps import CurrentUser, EngineDep, SettingsDep, is_htmx
from app.web.auth import still_signed_in
from app.web.render import render, render_block
from app.web.sse import job_event_stream, start_after, while_signed_in
from app.web import views
from app.web.views import dataset_labeller, redirect_to_run, run_view, template_ctx

router = APIRouter()

_BOOL = ("train_on_responses_only", "packing", "padding_free", "load_in_4bit", "add_template_tokens")


def _defaults() -> dict:
    vals = {k: f.get_default(call_default_factory=True) for k, f in TrainSpec.model_fields.items()
            if k not in ("model", "dataset")}
    vals.update(model="", dataset="", name="")
    return vals


def _form_ctx(engine, user, values: dict, errors: dict | None = None,
              general: list | None = None, tmpl: dict | None = None) -> dict:
    # a failed model cannot train: usable_models leaves it out (its reason is on the Models page)
    models = datasets_uc.usable_models(engine, user)
    # GRPO prompt datasets have no answers to train on: they are for /runs/new/grpo
    datasets = [d for d in datasets_uc.pickable_datasets(engine, user)
                if d.status == "processed" and d.format != "prompts"]
    if not values.get("model") and models:
        ready = [m for m in models if m.status == "ready"]
        values["model"] = (ready or models)[0].id
    if not values.get("dataset") and datasets:
        values["dataset"] = datasets[0].id
    return {"values": values, "errors": errors or {}, "general_errors": views.form_notices(user, general),
            "models": models, "datasets": datasets,
            "dataset_label": dataset_labeller(engine, user),
            "all_modules": ALL_LINEAR,
            "schedulers": SCHEDULERS,
            "tmpl": tmpl or template_ctx(engine, user, values.get("model")),
            "kept": views.kept_fields(values, TrainSpec, "run_new.html"),
            "clone_of": values.get("clone_of"), "clone_deleted": values.get("clone_deleted")}


def _model_or_none(engine, user, model_ref: str | None):
    try:
        return access.model(engine, user, model_ref) if model_ref else None
    except StudioError:
        return None


@router.get("/runs/new")
def new_run(request: Request, engine: EngineDep, user: CurrentUser, dataset: str | None = None,
            model: str | None = None, chat_template: str | None = None,
            max_seq_length: str | None = None, clone: str | None = None):
    """The run form, pre-filled from the query (e.g. the dataset page's "Train on this dataset":
    dataset, model, chat_template name and max_seq_length), or with ``clone`` from a run's
    settings (a GRPO run's open the GRPO form)."""
    if clone:
        return _clone_form(request, engine, user, clone_uc.clone_run(engine, user, clone))
    values = _defaults()
    values["dataset"] = dataset or ""
    values["model"] = model or ""
    # a dataset asked for that cannot train is said so, never silently swapped for another
    problem = runs_uc.sft_dataset_problem(engine, user, dataset) if dataset else None
    ctx = _form_ctx(engine, user, values, {"dataset": problem} if problem else None)
    given = (max_seq_length or "").strip()
    if given.isascii() and given.isdigit() and len(given) <= 9:  # "²" is a digit int() refuses
        values["max_seq_length"] = int(given)
    else:
        values["max_seq_length"] = datasets_uc.default_max_seq_length(
            _model_or_none(engine, user, values.get("model")))
    if chat_template:
        ctx["tmpl"] = template_ctx(engine, user, values.get("model"), chat_template)
    return render(request, "run_new.html", ctx, block="run_form")


def _clone_form(request: Request, engine, user, clone):
    if clone.kind != "sft":
        return RedirectResponse(clone.form_url, status_code=303)
    values = {**views.clone_values(clone, _defaults()), "clone_of": clone.run_id}
    ctx = _form_ctx(engine, user, values, tmpl=template_ctx(
        engine, user, values["model"], clone.template_choice, values.get("chat_template")))
    return render(request, "run_new.html", ctx, block="run_form")


@router.get("/runs/new/template")
def template_fragment(request: Request, engine: EngineDep, user: CurrentUser,
                      model: str | None = None, chat_template_choice: str | None = None):
    ctx = _form_ctx(engine, user, {**_defaults(), "model": model or ""},
                    tmpl=template_ctx(engine, user, model, chat_template_choice))
    return render(request, "run_new.html", ctx, block="chat_template")


@router.post("/runs/new/estimate")
async def estimate_fragment(request: Request, engine: EngineDep, settings: SettingsDep,
                            user: CurrentUser):
    """The run form's GPU memory estimate (htmx fragment) from the form's current values."""
    return await views.estimate_fragment(request, engine, settings, user, "sft")


def spec_from_form(form) -> tuple[dict, dict]:
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
    raw.pop("chat_template_name", None)
    choice = form.get("chat_template_choice")
    text = str(form.get("chat_template") or "").strip()
    if choice != "model":
        text = text or DEFAULT_TEMPLATES.get(str(choice or ""), "") or "chatml"
        raw["chat_template"] = values["chat_template"] = text
    else:
        raw.pop("chat_template", None)
    return raw, values


def cleared_numbers(form) -> dict[str, str]:
    """``{field: message}`` for the numeric fields submitted empty whose TrainSpec default is a
    number (``learning_rate``, ``r``, ...): refused rather than silently replaced by the default.
    ``max_steps`` may be empty (it means "use num_train_epochs")."""
    out = {}
    for key, field in TrainSpec.model_fields.items():
        default = field.default
        if key == "max_steps" or isinstance(default, bool) or not isinstance(default, (int, float)):
            continue
        v = form.get(key)
        if v is not None and not str(v).strip():
            out[key] = f"enter a value (the default is {default:g})"
    return out


@router.post("/runs")
async def create_run(request: Request, engine: EngineDep, settings: SettingsDep,
                     user: CurrentUser):
    form = await request.form()
    raw, values = spec_from_form(form)
    name = values.get("name") or None
    raw.pop("name", None)
    errors: dict[str, str] = {}
    if not raw.get("model"):
        errors["model"] = "choose a model (register one on the Models page)"
    if not raw.get("dataset"):
        errors["dataset"] = "choose a dataset (upload one on the Datasets page)"
    errors.update(cleared_numbers(form))
    run, errors, general = await views.create_from_form(
        TrainSpec, raw, errors,
        lambda spec: runs_uc.create_sft_run(engine, settings, user, spec, name), name=name)
    if run is None:
        tmpl = template_ctx(engine, user, values.get("model"), form.get("chat_template_choice"),
                            values.get("chat_template") or None)
        return render(request, "run_new.html", _form_ctx(engine, user, values, errors, general, tmpl),
                      block="run_form", status_code=422)
    return redirect_to_run(request, run)


@router.get("/runs/{run_id}")
def run_page(request: Request, run_id: str, engine: EngineDep, settings: SettingsDep,
             user: CurrentUser):
    """The run page; its ``place`` block (htmx, every 5 s while queued) says where the queued
    job stands (app.studio.run_place) and is built from :func:`app.web.views.place_view` alone."""
    polled = is_htmx(request) and request.headers.get("hx-target") == "place"
    # a form's refusal (e.g. Resume), shown once after its redirect
    ctx = views.place_view(engine, user, run_id) if polled else \
        run_view(engine, settings, user, run_id, flash.pop(request).get("controls_error"))
    return render(request, "run.html", {**ctx, "place": run_place(engine, settings, user,
                                                                  ctx["job"])},
                  block="artifacts")


@router.get("/runs/{run_id}/job")
def current_job(run_id: str, engine: EngineDep, user: CurrentUser) -> dict:
    """``{"job_id", "state"}`` of the run's current training job (a resume makes a new one): what
    an open run page of a cancelled or failed run polls to notice a resume made elsewhere
    (static/app.js), without the whole run read. Another user's run: 404."""
    _, job = access.run_with_job(engine, user, run_id)
    return {"job_id": job.id if job else None, "state": job.state if job else None}


@router.get("/runs/{run_id}/training-time")
def training_time_fragment(run_id: str, engine: EngineDep, user: CurrentUser):
    """The run page's training-time line as of now (an HTML fragment, ``#training-time-box``;
    static/app.js reads it again while the run trains; the figures are
    :func:`app.studio.train_time.training_time`'s). Another user's run: 404."""
    run, job = access.run_with_job(engine, user, run_id)
    return HTMLResponse(render_block("run.html", "training_time", {
        "run": run, "training_time": train_time.training_time(engine, job)}))


@router.get("/runs/{run_id}/cancel-question")
def cancel_question(run_id: str, engine: EngineDep, user: CurrentUser):
    """The Cancel button's confirmation as of now (text/plain; static/app.js asks it on click)."""
    return PlainTextResponse(resume_uc.cancel_question(engine, user, run_id))


@router.post("/runs/{run_id}/cancel")
def cancel_run(request: Request, run_id: str, engine: EngineDep, settings: SettingsDep,
               user: CurrentUser):
    runs_uc.cancel_run(engine, user, run_id)
    if is_htmx(request):
        return render(request, "run.html", run_view(engine, settings, user, run_id),
                      block="controls")
    return RedirectResponse(f"/runs/{run_id}", status_code=303)


@router.post("/runs/{run_id}/resume")
def resume_run(request: Request, run_id: str, engine: EngineDep, settings: SettingsDep,
               user: CurrentUser):
    """Resume a cancelled or failed run from its newest checkpoint; back to its page (whose
    live view follows the new job). A refusal (over the GPU memory quota, nothing to resume
    from) is post-redirect-get too: the run page shows its words once above the controls."""
    try:
        resume_uc.resume_run(engine, settings, user, run_id)
    except StudioError as exc:
        if exc.kind not in ("invalid", "conflict"):
            raise
        if is_htmx(request):
            return render(request, "run.html", run_view(engine, settings, user, run_id,
                                                        exc.message),
                          block="controls", status_code=409 if exc.kind == "conflict" else 422)
        flash.push(request, controls_error=exc.message)
        return RedirectResponse(f"/runs/{run_id}", status_code=303)
    if is_htmx(request):
        return Response(status_code=200, headers={"HX-Redirect": f"/runs/{run_id}"})
    return RedirectResponse(f"/runs/{run_id}", status_code=303)


@router.post("/runs/{run_id}/delete")
def delete_run(request: Request, run_id: str, engine: EngineDep, settings: SettingsDep,
               user: CurrentUser):
    """Delete the run and its files (the page asks first); back to the dashboard. While one of
    its jobs is active: the run page's controls with the reason (409)."""
    try:
        removal.delete_run(engine, settings, user, run_id)
    except StudioError as exc:
        if exc.kind != "conflict":
            raise
        return render(request, "run.html", run_view(engine, settings, user, run_id, exc.message),
                      block="controls", status_code=409)
    if is_htmx(request):
        return Response(status_code=200, headers={"HX-Redirect": "/"})
    return RedirectResponse("/", status_code=303)


@router.get("/runs/{run_id}/events")
async def run_events(request: Request, run_id: str, engine: EngineDep, user: CurrentUser,
                     after: str | None = None):
    """The run's job events over SSE (resumes after ``Last-Event-ID`` or ``?after=``)."""
    run = access.run(engine, user, run_id)
    if run.job_id is None:
        return Response(status_code=204)
    start = start_after(request.headers.get("last-event-id"), after)
    stream = while_signed_in(job_event_stream(engine, run.job_id, start),
                             lambda: still_signed_in(request))
    return EventSourceResponse(stream, ping=15,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
