"""Datasets: upload (streamed, size-limited), list, and the validation report page."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from app.data.errors import DatasetError
from app.store import repo
from app.store.specs import TrainSpec
from app.web.deps import get_engine, get_settings, is_htmx
from app.web.inspect import default_templates
from app.web.render import render
from app.web.services import default_model, report_for, upload_dataset
from app.web.uploads import UploadError

router = APIRouter()
DEFAULT_MAX_LEN = TrainSpec.model_fields["max_seq_length"].default


def _list_ctx(request: Request, **extra) -> dict:
    engine = get_engine(request)
    return {"datasets": repo.list_datasets(engine),
            "max_upload_mb": get_settings(request).max_upload_mb, **extra}


@router.get("/datasets")
def datasets_page(request: Request):
    return render(request, "datasets.html", _list_ctx(request), block="dataset_list")


@router.post("/datasets")
async def upload(request: Request):
    settings, engine = get_settings(request), get_engine(request)
    try:
        ds, _ = await upload_dataset(request, settings, engine)
    except UploadError as exc:
        return render(request, "datasets.html", _list_ctx(request, upload_error=exc.message),
                      block="upload_form", status_code=exc.status)
    except DatasetError as exc:
        return render(request, "datasets.html", _list_ctx(request, upload_error=str(exc)),
                      block="upload_form", status_code=400)
    url = f"/datasets/{ds.id}"
    if is_htmx(request):
        return Response(status_code=200, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


@router.get("/datasets/{dataset_id}")
def dataset_page(request: Request, dataset_id: str):
    engine = get_engine(request)
    ds = repo.get_dataset(engine, dataset_id)
    report = ds.report or None
    selected = None
    if report and report.get("model"):
        selected = next((m for m in repo.list_models(engine) if m.name == report["model"]), None)
    selected = selected or default_model(engine)
    return render(request, "dataset.html", {
        "dataset": ds, "report": report, "report_error": ds.error, "models": repo.list_models(engine),
        "selected_model": selected, "template_names": list(default_templates()),
        "max_seq_length": (report or {}).get("max_seq_length", DEFAULT_MAX_LEN)}, block="report")


@router.get("/datasets/{dataset_id}/report")
async def dataset_report(request: Request, dataset_id: str, model: str | None = None,
                         chat_template: str | None = None, max_seq_length: str | None = None):
    engine = get_engine(request)
    ds = repo.get_dataset(engine, dataset_id)
    chosen = None
    if model:
        try:
            chosen = repo.get_model(engine, model)
        except repo.NotFound:
            chosen = None
    chosen = chosen or default_model(engine)
    ctx = {"dataset": ds, "models": repo.list_models(engine), "selected_model": chosen,
           "template_names": list(default_templates()), "report": None, "report_error": None}
    try:
        length = int(max_seq_length) if max_seq_length not in (None, "") else DEFAULT_MAX_LEN
        if length < 8:
            raise ValueError
    except ValueError:
        ctx["report_error"] = "max_seq_length must be a whole number of at least 8"
        ctx["report"] = ds.report
        ctx["max_seq_length"] = max_seq_length
        return render(request, "dataset.html", ctx, block="report", status_code=422)
    ctx["max_seq_length"] = length
    try:
        ctx["report"] = await report_for(ds.path, chosen, chat_template, length,
                                         get_settings(request))
    except DatasetError as exc:
        ctx["report_error"] = str(exc)
    return render(request, "dataset.html", ctx, block="report")
