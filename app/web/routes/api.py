"""Native JSON API under /api: what the OpenAI shape lacks (specs, metrics, artifacts, models)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from app.store import events, repo
from app.store.specs import TrainSpec
from app.web.deps import get_engine, get_settings
from app.web.errors import ApiError
from app.web.routes.models import ModelFormError, register_model
from app.web.routes.runs import FieldError, create_checked
from app.web.services import delete_model, field_errors

router = APIRouter(prefix="/api")


def _dump(obj) -> dict[str, Any]:
    return obj.model_dump(mode="json")


def metrics_summary(engine, job_id: int | None) -> dict[str, Any]:
    """Count, first/last/min loss and the latest metric event of a job."""
    if job_id is None:
        return {"count": 0}
    losses, latest, last = [], None, 0
    while True:
        batch = events.since(engine, job_id, last, 5000, types=["metric"])
        if not batch:
            break
        for ev in batch:
            if isinstance(ev.data.get("loss"), (int, float)):
                losses.append(ev.data["loss"])
            latest = ev.data
        last = batch[-1].id
    return {"count": len(losses), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "min_loss": min(losses) if losses else None,
            "latest": latest}


def run_json(engine, run, full: bool = False) -> dict[str, Any]:
    """A run as the JSON API shows it (job state, timestamps; metrics and artifacts if full)."""
    _, job = repo.run_with_job(engine, run.id)
    out = {**_dump(run), "state": job.state if job else None,
           "error": job.error if job else None,
           "cancel_requested": bool(job and job.cancel_requested),
           "started_at": job.started_at if job else None,
           "finished_at": job.finished_at if job else None,
           "events_url": f"/runs/{run.id}/events"}
    if full:
        out["metrics"] = metrics_summary(engine, run.job_id)
        out["artifacts"] = [{**_dump(a), "download_url": f"/artifacts/{a.id}/download"}
                            for a in repo.list_artifacts(engine, run.id)]
    return out


@router.get("/runs")
def list_runs(request: Request, limit: int = 100, after: str | None = None):
    engine = get_engine(request)
    return {"data": [run_json(engine, r) for r in repo.list_runs(engine, limit=limit, after=after)]}


@router.get("/runs/{run_id}")
def get_run(request: Request, run_id: str):
    engine = get_engine(request)
    return run_json(engine, repo.get_run(engine, run_id), full=True)


async def json_object(request: Request, what: str = "a JSON object") -> dict[str, Any]:
    """The request body, which must be a JSON object. Raises ApiError 400."""
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be {what}")
    return body


def invalid_spec(exc: ValidationError) -> JSONResponse:
    """The 422 answer to a spec that fails validation: the first field in ``message`` and
    ``param``, every field under ``fields``."""
    errors, general = field_errors(exc)
    first = next(iter(errors.items()), (None, general[0] if general else "invalid spec"))
    return JSONResponse({"error": {"message": f"{first[0]}: {first[1]}" if first[0] else first[1],
                                   "param": first[0], "code": "invalid_value",
                                   "fields": errors}}, status_code=422)


@router.post("/runs", status_code=201)
async def create_run(request: Request):
    engine = get_engine(request)
    body = await json_object(request, "a JSON object (a TrainSpec)")
    name = body.pop("name", None)
    try:
        spec = TrainSpec(**body)
    except ValidationError as exc:
        return invalid_spec(exc)
    try:
        run, _ = create_checked(engine, get_settings(request), spec, name)
    except FieldError as exc:
        raise ApiError(404 if exc.message.startswith("no ") else 422, exc.message, exc.field) from None
    return run_json(engine, run, full=True)


@router.get("/datasets")
def list_datasets(request: Request):
    return {"data": [_dump(d) for d in repo.list_datasets(get_engine(request))]}


@router.get("/datasets/{dataset_id}")
def get_dataset(request: Request, dataset_id: str):
    return _dump(repo.get_dataset(get_engine(request), dataset_id))


@router.get("/models")
def list_models(request: Request):
    return {"data": [_dump(m) for m in repo.list_models(get_engine(request))]}


@router.post("/models", status_code=201)
async def create_model(request: Request):
    body = await json_object(request)
    data = {k: str(v) for k, v in body.items() if v is not None}
    try:
        model = register_model(get_engine(request), data)
    except ModelFormError as exc:
        field, msg = next(iter(exc.errors.items()))
        return JSONResponse({"error": {"message": f"{field}: {msg}", "param": field,
                                       "code": "invalid_value", "fields": exc.errors}},
                            status_code=422)
    return _dump(model)


@router.delete("/models/{model_id}")
def remove_model(request: Request, model_id: str):
    """Delete a model no run uses (409 ``model_in_use`` otherwise)."""
    try:
        model = delete_model(get_engine(request), get_settings(request), model_id)
    except repo.InUse as exc:
        raise ApiError(409, str(exc), "model_id", "model_in_use") from None
    return {"id": model.id, "name": model.name, "deleted": True}
