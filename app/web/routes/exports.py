"""The run page's Exports card (form + list, refreshed while an export is active) and the zip
download of an export's files, cancelling and deleting one. The rules are in :mod:`app.studio.exports`."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from app.studio import exports as exports_uc
from app.studio import removal
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep, SettingsDep, is_htmx
from app.web.errors import conflict_of
from app.web.render import render
from app.web.views import exports_view

router = APIRouter()
#: The export form's fields: an error naming one is shown beside it.
FORM_FIELDS = ("format", "quantization", "dtype")


@router.get("/runs/{run_id}/exports")
def exports_fragment(request: Request, run_id: str, engine: EngineDep, user: CurrentUser):
    return render(request, "_exports.html", exports_view(engine, user, run_id), block="exports")


@router.post("/runs/{run_id}/exports")
async def exports_submit(request: Request, run_id: str, engine: EngineDep, user: CurrentUser):
    form = await request.form()
    values = {"format": form.get("format"), "quantization": form.getlist("quantization"),
              "dtype": form.get("dtype") or None}
    if values["format"] not in ("gguf", "ollama"):
        values["quantization"] = []  # the form always posts its checkboxes
    error, field_errors = None, {}
    try:
        exports_uc.queue_export(engine, user, run_id, values)  # the same one live: reused
    except StudioError as exc:
        if exc.kind == "not_found":
            raise
        if exc.field in FORM_FIELDS:  # shown beside its field
            field_errors[exc.field] = exc.message
        else:
            error = f"{exc.field}: {exc.message}" if exc.field else exc.message
    failed = error is not None or bool(field_errors)
    status = 422 if failed and is_htmx(request) else 200
    return render(request, "_exports.html",
                  exports_view(engine, user, run_id, error, values, field_errors),
                  block="exports", status_code=status)


@router.post("/exports/{export_id}/delete")
def export_delete(request: Request, export_id: int, engine: EngineDep, settings: SettingsDep,
                  user: CurrentUser):
    """Delete an export and its files (the card asks first); the run's Exports card again, with
    the reason (409) while the export is being built."""
    run_id = exports_uc.export_job(engine, user, export_id).run_id
    error = conflict_of(removal.delete_export, engine, settings, user, export_id)
    return render(request, "_exports.html", exports_view(engine, user, run_id, error),
                  block="exports", status_code=409 if error else 200)


@router.post("/exports/{export_id}/cancel")
def export_cancel(request: Request, export_id: int, engine: EngineDep, user: CurrentUser):
    """Stop an export being built (the card asks first); the run's Exports card again, with the
    reason (409) when it had already ended."""
    run_id = exports_uc.export_job(engine, user, export_id).run_id
    error = conflict_of(exports_uc.cancel_export, engine, user, export_id)
    if not is_htmx(request) and error is None:
        return RedirectResponse(f"/runs/{run_id}#exports", status_code=303)
    return render(request, "_exports.html", exports_view(engine, user, run_id, error),
                  block="exports", status_code=409 if error else 200)


@router.get("/exports/{export_id}/download.zip")
async def export_zip(export_id: int, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    path, name = await run_in_threadpool(exports_uc.zip_export, engine, settings, user, export_id)
    return FileResponse(path, filename=name, media_type="application/zip",
                        background=BackgroundTask(Path(path).unlink, missing_ok=True))
