"""Native JSON API for exports: queue one for a finished run, list a run's, read one, stream its
events.

``POST /api/runs/{run_id}/exports`` with ``{"format", "quantization": str | [str], "dtype"?}``
queues an ``export`` job and answers ``{"id", "status"}`` (201; 200 with the one already queued
or running when the same export is asked again); ``GET /api/exports/{id}``
returns ``status``, ``error``, ``progress``, ``verification`` and ``files``;
``POST /api/exports/{id}/cancel`` stops one being built (409 once it ended);
``DELETE /api/exports/{id}`` deletes an export that has ended, with its files.
"""
from __future__ import annotations

from fastapi import APIRouter, Request, Response
from sse_starlette.sse import EventSourceResponse

from app.studio import exports as exports_uc
from app.studio import removal
from app.web.api.schemas import ExportList, ExportOut, ExportQueued, json_object
from app.web.auth import still_signed_in
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.sse import job_event_stream, start_after, while_signed_in

router = APIRouter(prefix="/api", tags=["exports"])


@router.post("/runs/{run_id}/exports", status_code=201, response_model=ExportQueued)
async def create_export(run_id: str, request: Request, response: Response, engine: EngineDep,
                        user: CurrentUser):
    """Queue an export (201); the same export of the run already queued or running is
    answered as it is (200), not queued twice."""
    body = await json_object(request, 'a JSON object: {"format": ..., "quantization": ...}')
    job, reused = exports_uc.queue_export(engine, user, run_id, body)
    if reused:
        response.status_code = 200
    return ExportQueued(id=job.id, status=job.state)


@router.get("/runs/{run_id}/exports", response_model=ExportList)
def list_exports(run_id: str, engine: EngineDep, user: CurrentUser):
    return ExportList(data=exports_uc.list_exports(engine, user, run_id))


@router.get("/exports/{export_id}", response_model=ExportOut)
def get_export(export_id: int, engine: EngineDep, user: CurrentUser):
    return exports_uc.export_info(engine, exports_uc.export_job(engine, user, export_id))


@router.post("/exports/{export_id}/cancel", response_model=ExportOut)
def cancel_export(export_id: int, engine: EngineDep, user: CurrentUser):
    """Stop an export that is queued or being built (its partial files are removed); answers
    the export (409 when it already ended)."""
    return exports_uc.export_info(engine, exports_uc.cancel_export(engine, user, export_id))


@router.delete("/exports/{export_id}", response_model=ExportOut)
def delete_export(export_id: int, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """Delete an export and its files; answers it as it was (409 while it is being built)."""
    info = exports_uc.export_info(engine, exports_uc.export_job(engine, user, export_id))
    removal.delete_export(engine, settings, user, export_id)
    return info


@router.get("/exports/{export_id}/events")
async def export_events(export_id: int, request: Request, engine: EngineDep, user: CurrentUser,
                        after: str | None = None):
    """The export job's events over SSE (resumes after ``Last-Event-ID`` or ``?after=``)."""
    job = exports_uc.export_job(engine, user, export_id)
    start = start_after(request.headers.get("last-event-id"), after)
    stream = while_signed_in(job_event_stream(engine, job.id, start),
                             lambda: still_signed_in(request))
    return EventSourceResponse(stream, ping=15)
