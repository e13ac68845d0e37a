"""The playground page (``/playground?model=…``) and its JSON API under ``/api/playground``:
open (or reuse) a session, send a prompt, follow its events over SSE, stop it. Every rule is in
:mod:`app.studio.playground`; generation runs in the session's worker job."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from app.studio import playground as pg
from app.studio.errors import StudioError
from app.studio.paging import page_limit
from app.web.api.schemas import json_object
from app.web.auth import still_signed_in
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.render import render
from app.web.sse import job_event_stream, start_after, while_signed_in

router = APIRouter()


@router.get("/playground")
def playground_page(request: Request, engine: EngineDep, settings: SettingsDep,
                    user: CurrentUser, model: str | None = None):
    """Chat with a model: a run's (final or a checkpoint) beside its base, a GGUF export, or a
    base model; ``model`` is one of the ids the picker lists (default: the newest run's)."""
    choices = pg.targets(engine, user)
    if not model and choices:
        model = next((c["model"] for c in choices if c["group"] != "Base models"),
                     choices[0]["model"])
    target, problem = None, None
    if model:
        try:
            target = pg.resolve(engine, user, model)
        except StudioError as e:
            if e.kind == "not_found":
                raise
            problem = e.message
    return render(request, "playground.html", {
        "choices": choices, "model": model, "target": target, "problem": problem,
        "note": pg.context_note(target) if target else None, "labels": pg.SIDE_LABELS,
        "idle_seconds": settings.playground_idle_seconds,
        "defaults": pg.DEFAULTS, "limits": pg.LIMITS})


@router.post("/api/playground/sessions", status_code=201)
async def open_session(request: Request, engine: EngineDep, settings: SettingsDep,
                       user: CurrentUser):
    """Open a session for ``{"model": …}``, or answer the caller's live one for that model
    (200). The sampling parameters of the first prompt (``temperature``, ``top_p``,
    ``max_tokens``, ``seed``, ``top_k``, ``min_p``, ``repetition_penalty``), when given, are
    checked before any session is queued."""
    body = await json_object(request)
    job, reused = await run_in_threadpool(pg.open_session, engine, settings, user,
                                          body.get("model"), body)
    info = await run_in_threadpool(pg.session_info, engine, settings, user, job)
    return JSONResponse({**info, "reused": reused}, status_code=200 if reused else 201)


@router.get("/api/playground/sessions")
def list_sessions(engine: EngineDep, settings: SettingsDep, user: CurrentUser,
                  limit: str | None = None):
    """The caller's sessions (an admin's: everyone's), newest first, each as
    ``GET /api/playground/sessions/{id}`` answers it; ``limit``: 1 to 100 (default 20)."""
    return {"object": "list", "data": pg.list_sessions(engine, settings, user,
                                                      page_limit(limit, 20, 100))}


@router.get("/api/playground/sessions/{session_id}")
def get_session(session_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """One of the caller's sessions (status queued, loading, ready or ended; while queued its
    ``queue``: position, reason and estimated start, the Queue page's words)."""
    return pg.session_info(engine, settings, user, pg.session(engine, user, session_id))


@router.post("/api/playground/sessions/{session_id}/prompts", status_code=202)
async def send_prompt(session_id: str, request: Request, engine: EngineDep, user: CurrentUser):
    """Send a prompt (``messages`` or ``messages_by_side``, ``system``, ``temperature``,
    ``top_p``, ``max_tokens``, ``seed``, ``top_k``, ``min_p``, ``repetition_penalty``); its
    tokens arrive as the session's events."""
    await run_in_threadpool(pg.session, engine, user, session_id)  # 404 before a 422
    body = await json_object(request)
    return await run_in_threadpool(pg.send_prompt, engine, user, session_id, body)


@router.post("/api/playground/sessions/{session_id}/prompts/{request_id}/stop")
def stop_prompt(session_id: str, request_id: str, engine: EngineDep, user: CurrentUser):
    """Stop the answer to one prompt (the page's Stop button): each side ends with its text so
    far and ``finish_reason`` ``stopped``; the session keeps its model for the next prompt."""
    return pg.stop_prompt(engine, user, session_id, request_id)


@router.post("/api/playground/sessions/{session_id}/prompts/{request_id}/leave")
def leave_prompt(session_id: str, request_id: str, engine: EngineDep, user: CurrentUser):
    """The page that sent the prompt is gone (closed, or left for another page) before the
    answer ended: the answer stops, and a session still waiting in the queue leaves it when no
    other prompt waits on it. The page sends it as it unloads (a keepalive request)."""
    return pg.leave_prompt(engine, user, session_id, request_id)


@router.post("/api/playground/sessions/{session_id}/stop")
def stop_session(session_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """End the session now: its model is unloaded and its GPU slot freed."""
    return pg.session_info(engine, settings, user, pg.stop_session(engine, user, session_id))


@router.get("/api/playground/sessions/{session_id}/events")
async def session_events(session_id: str, request: Request, engine: EngineDep,
                         user: CurrentUser, after: str | None = None):
    """The session's events over SSE (``session``, ``prompt``, ``token``, ``answer``, ``state``,
    ``log``), resuming after ``Last-Event-ID`` or ``?after=``."""
    job = await run_in_threadpool(pg.session, engine, user, session_id)
    start = start_after(request.headers.get("last-event-id"), after)
    stream = while_signed_in(job_event_stream(engine, job.id, start),
                             lambda: still_signed_in(request))
    return EventSourceResponse(stream, ping=15,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
