"""Exports of a finished run: adapter, merged 16-bit, GGUF, Ollama — each a verified queue job.

Native API:

* ``POST /api/runs/{run_id}/exports`` with ``{"format", "quantization": str | [str], "dtype"?}``
  queues an ``export`` job and answers ``{"id", "status"}`` (201);
* ``GET /api/runs/{run_id}/exports`` lists them; ``GET /api/exports/{id}`` returns ``status``,
  ``error``, ``progress``, ``verification`` (``passed`` and the figures, or the diff) and
  ``files`` (``name``, ``size``, ``sha256``, ``url``); ``GET /api/exports/{id}/events`` streams
  the job's events over SSE.

Pages: the run page's "Exports" card posts to ``/runs/{run_id}/exports`` and polls its own
fragment while an export is active; ``/exports/{id}/download.zip`` zips an export's files.
"""
from __future__ import annotations

import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from app.store import events, queue, repo
from app.store.schema import Job, JobState
from app.store.specs import ExportSpec
from app.web.deps import get_engine, get_settings
from app.web.errors import ApiError
from app.web.render import render
from app.web.services import is_under
from app.web.sse import job_event_stream, start_after

router = APIRouter()

FORMATS = [("adapter", "LoRA adapter (PEFT)"), ("merged_16bit", "Merged 16-bit (safetensors)"),
           ("gguf", "GGUF"), ("ollama", "Ollama (GGUF + Modelfile)")]
QUANTS = ["F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K"]


def _export_job(engine, export_id: int) -> Job:
    try:
        job = queue.get_job(engine, export_id)
    except queue.JobNotFound:
        job = None
    if job is None or job.kind != "export":
        raise ApiError(404, f"no export with id {export_id}", param="id")
    return job


def export_json(engine, job: Job) -> dict[str, Any]:
    """The API view of one export job (see the module docstring)."""
    payload, result = job.payload or {}, job.result or {}
    export_key = result.get("export_id") or payload.get("export_id") or f"export-{job.id}"
    files = [{"name": a.name, "size": a.bytes, "sha256": a.sha256,
              "url": f"/artifacts/{a.id}/download"}
             for a in repo.list_artifacts(engine, job.run_id, kind=payload.get("format"))
             if (a.meta or {}).get("export_id") == export_key]
    verification = result.get("verification")
    if verification is None and job.state == JobState.FAILED:
        for ev in reversed(events.since(engine, job.id, 0, 5000, types=["log"])):
            if "verification" in ev.data:
                verification = ev.data["verification"]
                break
    prog = events.latest(engine, job.id, "progress")
    return {"id": job.id, "object": "export", "run_id": job.run_id,
            "format": payload.get("format"), "quantization": payload.get("quantization", []),
            "dtype": payload.get("dtype"), "status": job.state, "error": job.error,
            "created_at": job.created_at, "finished_at": job.finished_at,
            "progress": prog.data if prog else None, "verification": verification,
            "files": files, "ollama": result.get("ollama"),
            "events_url": f"/api/exports/{job.id}/events"}


def queue_export(engine, run_id: str, body: dict[str, Any]) -> Job:
    """Validate an export request for a finished run and queue its job.

    Raises:
        ApiError: 404 unknown run, 409 run not finished, 422 bad format/quantization.
    """
    run, job = repo.run_with_job(engine, run_id)
    if job is None or job.state != JobState.SUCCEEDED:
        state = job.state if job else "unknown"
        raise ApiError(409, f"run {run_id} has not finished training (state: {state}); "
                            "export it once it has succeeded")
    unknown = sorted(set(body) - {"format", "quantization", "dtype"})
    if unknown:
        raise ApiError(422, f"unknown field {unknown[0]!r}; an export takes format, quantization "
                            "and dtype", param=unknown[0])
    quant = body.get("quantization") or []
    if isinstance(quant, str):
        quant = [q.strip() for q in quant.replace(",", " ").split() if q.strip()]
    try:
        spec = ExportSpec(run_id=run.id, format=body.get("format"),
                          quantization=quant, dtype=body.get("dtype") or "bf16")
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1]) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(422, f"{field}: {msg}", param=field) from None
    if spec.quantization and spec.format not in ("gguf", "ollama"):
        raise ApiError(422, f"quantization: applies to gguf and ollama exports, not {spec.format}",
                       param="quantization")
    payload = spec.model_dump(mode="json")
    if spec.format == "ollama":
        model = repo.get_model(engine, run.model_id)
        payload["model_name"] = re.sub(r"[^a-z0-9_.-]+", "-", f"{model.name}-{run.id[-8:]}".lower())
    return queue.enqueue(engine, "export", payload, run_id=run.id, priority=5, max_attempts=2)


# ---- JSON API ---------------------------------------------------------------------------
@router.post("/api/runs/{run_id}/exports", status_code=201)
async def api_create_export(request: Request, run_id: str):
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the body must be JSON: {\"format\": ..., \"quantization\": ...}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    job = queue_export(get_engine(request), run_id, body)
    return {"id": job.id, "status": job.state}


@router.get("/api/runs/{run_id}/exports")
def api_list_exports(request: Request, run_id: str):
    engine = get_engine(request)
    repo.get_run(engine, run_id)
    return {"object": "list",
            "data": [export_json(engine, j) for j in repo.list_run_jobs(engine, run_id, "export")]}


@router.get("/api/exports/{export_id}")
def api_get_export(request: Request, export_id: int):
    engine = get_engine(request)
    return export_json(engine, _export_job(engine, export_id))


@router.get("/api/exports/{export_id}/events")
async def api_export_events(request: Request, export_id: int, after: str | None = None):
    engine = get_engine(request)
    job = _export_job(engine, export_id)
    start = start_after(request.headers.get("last-event-id"), after)
    return EventSourceResponse(job_event_stream(engine, job.id, start), ping=15)


# ---- pages ------------------------------------------------------------------------------
def exports_view(engine, run_id: str, error: str | None = None,
                 values: dict[str, Any] | None = None) -> dict[str, Any]:
    run, job = repo.run_with_job(engine, run_id)
    items = [export_json(engine, j) for j in repo.list_run_jobs(engine, run_id, "export")]
    return {"run": run, "exports": items, "export_formats": FORMATS, "export_quants": QUANTS,
            "export_error": error, "export_values": values or {"format": "gguf", "quantization": ["Q8_0"]},
            "can_export": bool(job and job.state == JobState.SUCCEEDED),
            "exports_active": any(e["status"] in (JobState.QUEUED, JobState.RUNNING) for e in items)}


@router.get("/runs/{run_id}/exports")
def exports_fragment(request: Request, run_id: str):
    return render(request, "_exports.html", exports_view(get_engine(request), run_id), block="exports")


@router.post("/runs/{run_id}/exports")
async def exports_submit(request: Request, run_id: str):
    engine = get_engine(request)
    form = await request.form()
    values = {"format": form.get("format"), "quantization": form.getlist("quantization"),
              "dtype": form.get("dtype") or "bf16"}
    if values["format"] not in ("gguf", "ollama"):
        values["quantization"] = []  # the form always posts its checkboxes
    error = None
    try:
        queue_export(engine, run_id, values)
    except ApiError as exc:
        error = exc.message
    status = 200 if error is None else 422
    return render(request, "_exports.html", exports_view(engine, run_id, error, values),
                  block="exports", status_code=status if request.headers.get("hx-request") else 200)


@router.get("/exports/{export_id}/download.zip")
def export_zip(request: Request, export_id: int):
    engine, settings = get_engine(request), get_settings(request)
    info = export_json(engine, _export_job(engine, export_id))
    if info["status"] != JobState.SUCCEEDED or not info["files"]:
        why = "is still running" if info["status"] in (JobState.QUEUED, JobState.RUNNING) else \
            f"{info['status']}; a failed export offers no files"
        raise ApiError(409, f"export {export_id} has no files: it {why}")
    arts = {a.name: a for a in repo.list_artifacts(engine, info["run_id"], kind=info["format"])}
    tmp = tempfile.NamedTemporaryFile(prefix="whetstone-export-", suffix=".zip", delete=False)
    tmp.close()
    with zipfile.ZipFile(tmp.name, "w", zipfile.ZIP_STORED) as z:
        for f in info["files"]:
            path = Path(arts[f["name"]].path)
            if is_under(path, settings.data_dir) and path.is_file():
                z.write(path, arcname=f["name"])
    name = f"{info['run_id']}-{info['format']}-{export_id}.zip"
    return FileResponse(tmp.name, filename=name, media_type="application/zip",
                        background=BackgroundTask(Path(tmp.name).unlink, missing_ok=True))


