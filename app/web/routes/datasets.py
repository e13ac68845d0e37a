"""Datasets: upload (streamed, size-limited), list, and the validation report page."""
from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from app.data.chat_template import DEFAULT_TEMPLATES
from app.data.errors import DatasetError
from app.studio import access, seqlen, untrained, validation
from app.studio import dataset_columns
from app.studio import datasets as datasets_uc
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep, SettingsDep, current_user, get_engine, get_settings, is_htmx
from app.web.auth import still_signed_in
from app.web.render import render
from app.web.views import owner_names
from app.web.sse import job_event_stream, start_after, while_signed_in
from app.web.uploads import UploadError, receive_upload

router = APIRouter()


def _list_ctx(request: Request, **extra) -> dict:
    engine, user = get_engine(request), current_user(request)
    return {"datasets": datasets_uc.list_datasets(engine, user), "owners": owner_names(engine, user),
            "max_upload_mb": get_settings(request).max_upload_mb, **extra}


@router.get("/datasets")
def datasets_page(request: Request, user: CurrentUser):
    return render(request, "datasets.html", _list_ctx(request), block="dataset_list")


@router.post("/datasets")
async def upload(request: Request, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    try:
        up = await receive_upload(request, settings.data_dir / "uploads", settings.max_upload_mb)
        ds = await run_in_threadpool(datasets_uc.record_upload, engine, settings, user,
                                     up.take(), up.filename or "upload", up.bytes)
    except UploadError as exc:
        return render(request, "datasets.html", _list_ctx(request, upload_error=exc.message),
                      block="upload_form", status_code=exc.status)
    except StudioError as exc:
        if exc.kind != "invalid":
            raise
        return render(request, "datasets.html", _list_ctx(request, upload_error=exc.message),
                      block="upload_form", status_code=400)
    url = f"/datasets/{ds.id}"
    if is_htmx(request):
        return Response(status_code=200, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


def train_url(ds, model, report: dict | None, max_seq_length) -> str:
    """/runs/new pre-filled with this dataset and the model, template and length chosen here."""
    q = {"dataset": ds.id}
    if model is not None:
        q["model"] = model.id
    name = (report or {}).get("template_name")
    if name and name not in ("custom", "model"):
        q["chat_template"] = name
    if max_seq_length not in (None, ""):
        q["max_seq_length"] = max_seq_length
    return "/runs/new?" + urlencode(q)


def _pick_model(engine, user, model: str | None, report: dict | None = None):
    """The model a report is computed for: the asked one, else the stored report's, else the
    default (only models the user may use)."""
    for ref in (model, (report or {}).get("model")):
        if ref:
            try:
                return access.model(engine, user, ref)
            except StudioError:
                pass
    return datasets_uc.default_model(engine, user)


async def _report_ctx(request: Request, ds, model: str | None, chat_template: str | None,
                      max_seq_length: str | None) -> tuple[dict, int]:
    """(page context, status) of the report of ``ds`` for the chosen model/template/length."""
    engine, user = get_engine(request), current_user(request)
    chosen = _pick_model(engine, user, model)
    ctx = {"dataset": ds, "models": datasets_uc.usable_models(engine, user),
           "selected_model": chosen, "template_names": list(DEFAULT_TEMPLATES), "report": None,
           "report_error": None, "length_bounds": seqlen.length_bounds()}
    try:
        length = seqlen.report_length(max_seq_length, chosen)
    except StudioError as exc:
        ctx["report_error"] = exc.message
        ctx["report"] = ds.report
        ctx["max_seq_length"] = max_seq_length
        return ctx, 422
    ctx["max_seq_length"] = length
    try:
        ctx["report"] = await run_in_threadpool(
            datasets_uc.report_for, ds.path, chosen, chat_template, length, get_settings(request),
            column_mapping=dataset_columns.column_mapping(ds))
    except DatasetError as exc:
        ctx["report_error"] = str(exc)
    ctx["train_url"] = train_url(ds, chosen, ctx["report"], length)
    ctx["untrained_banner"] = untrained.report_banner(ctx["report"], chosen)
    return ctx, 200


def validating_page(request: Request, ds):
    """A dataset still being validated: its progress, followed live over SSE."""
    return render(request, "dataset_validating.html", {
        "dataset": ds, "progress": (ds.report or {}).get("validating") or {},
        "progress_text": validation.progress_text(ds).replace("still validating", "validating")})


def prompt_dataset_page(request: Request, ds):
    """A GRPO prompt dataset's page: rows, prompt/answer columns, example prompts and a link to
    the GRPO run form (the SFT report and run form do not apply). One that failed validation:
    the GRPO upload again, with the columns asked for and the message at its field."""
    upload = (ds.report or {}).get("upload") or {}
    values = {"upload_prompt_column": upload.get("prompt_column") or "",
              "upload_answer_column": upload.get("answer_column") or ""}
    errors = {}
    if ds.status == "error" and ds.error:
        field = upload.get("error_field")
        errors["upload_" + field if field in ("prompt_column", "answer_column") else "upload"] = \
            ds.error
    return render(request, "dataset_prompts.html", {"dataset": ds, "values": values,
                                                    "errors": errors})


@router.get("/datasets/{dataset_id}")
async def dataset_page(request: Request, dataset_id: str, engine: EngineDep, user: CurrentUser,
                       model: str | None = None, chat_template: str | None = None,
                       max_seq_length: str | None = None):
    """The dataset's stored report; with ``model``/``chat_template``/``max_seq_length`` in the
    query (the selector submitted without htmx, or a shared link) the report for those."""
    ds = validation.check_stale(engine, access.dataset(engine, user, dataset_id))
    if ds.status == validation.VALIDATING:
        return validating_page(request, ds)
    if datasets_uc.uploaded_for_grpo(ds):
        return prompt_dataset_page(request, ds)
    if any(v not in (None, "") for v in (model, chat_template, max_seq_length)):
        ctx, status = await _report_ctx(request, ds, model, chat_template, max_seq_length)
        return render(request, "dataset.html", ctx, block="report", status_code=status)
    return render(request, "dataset.html", _stored_ctx(request, ds), block="report")


def _stored_ctx(request: Request, ds, **extra) -> dict:
    """The dataset page's context from the stored report, with the column-mapping form."""
    engine, user = get_engine(request), current_user(request)
    report = datasets_uc.stored_report(ds)
    selected = _pick_model(engine, user, None, report)
    length = (report or {}).get("max_seq_length", datasets_uc.default_max_seq_length(selected))
    return {"dataset": ds, "report": report, "report_error": ds.error,
            "models": datasets_uc.usable_models(engine, user), "selected_model": selected,
            "template_names": list(DEFAULT_TEMPLATES), "max_seq_length": length,
            "length_bounds": seqlen.length_bounds(), "train_url": train_url(ds, selected, report, length),
            "untrained_banner": untrained.report_banner(report, selected),
            "mapping_form": dataset_columns.mapping_form(ds), **extra}


@router.post("/datasets/{dataset_id}/delete")
def delete_dataset(request: Request, dataset_id: str, engine: EngineDep, settings: SettingsDep,
                   user: CurrentUser):
    """Delete the dataset and its file (the page asks first); on to the Datasets page. While a
    queued or running job of a run uses it: the reason in place of the button (409)."""
    try:
        datasets_uc.delete_dataset(engine, settings, user, dataset_id)
    except StudioError as exc:
        if exc.kind != "conflict":
            raise
        return render(request, "_dataset_delete.html",
                      {"dataset": access.dataset(engine, user, dataset_id),
                       "delete_error": exc.message}, block="dataset_delete", status_code=409)
    if is_htmx(request):
        return Response(status_code=200, headers={"HX-Redirect": "/datasets"})
    return RedirectResponse("/datasets", status_code=303)


@router.post("/datasets/{dataset_id}/columns")
async def map_columns(request: Request, dataset_id: str, engine: EngineDep,
                      settings: SettingsDep, user: CurrentUser):
    """Save the column mapping (instruction, input, output, system: a column each) and validate
    the dataset again with it; a bad mapping re-renders the page with the field's error."""
    form = await request.form()
    mapping = {role: str(form.get(role) or "") for role in ("instruction", "input", "output",
                                                            "system")}
    try:
        ds = await run_in_threadpool(dataset_columns.set_column_mapping, engine, settings, user,
                                     dataset_id, mapping)
    except StudioError as exc:
        if exc.kind not in ("invalid", "conflict"):
            raise
        ds = access.dataset(engine, user, dataset_id)
        ctx = _stored_ctx(request, ds, mapping_error=exc.message, mapping_field=exc.field)
        if ctx["mapping_form"]:
            ctx["mapping_form"] = {**ctx["mapping_form"], "mapping": mapping}
        return render(request, "dataset.html", ctx, block="report",
                      status_code=400 if exc.kind == "invalid" else 409)
    url = f"/datasets/{ds.id}"
    if is_htmx(request):
        return Response(status_code=200, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


@router.get("/datasets/{dataset_id}/report")
async def dataset_report(request: Request, dataset_id: str, engine: EngineDep, user: CurrentUser,
                         model: str | None = None, chat_template: str | None = None,
                         max_seq_length: str | None = None):
    ds = access.dataset(engine, user, dataset_id)
    if ds.status == validation.VALIDATING:
        return validating_page(request, ds)
    if datasets_uc.uploaded_for_grpo(ds):
        return prompt_dataset_page(request, ds)
    ctx, status = await _report_ctx(request, ds, model, chat_template, max_seq_length)
    ctx["oob_train_link"] = is_htmx(request)
    return render(request, "dataset.html", ctx, block="report", status_code=status)


@router.get("/datasets/{dataset_id}/events")
async def dataset_events(request: Request, dataset_id: str, engine: EngineDep, user: CurrentUser,
                         after: str | None = None):
    """SSE of the dataset's validation job (``progress``: "validating n / N rows", then
    ``state`` and ``end``); 204 when it has none."""
    ds = access.dataset(engine, user, dataset_id)
    job_id = validation.job_id(ds)
    if job_id is None:
        return Response(status_code=204)
    start = start_after(request.headers.get("last-event-id"), after)
    stream = while_signed_in(job_event_stream(engine, job_id, start),
                             lambda: still_signed_in(request))
    return EventSourceResponse(stream, ping=15,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
