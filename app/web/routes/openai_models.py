"""The OpenAI Models API under /v1: registered base models and the fine-tuned models of
succeeded jobs.

A base model's id is its name (``stories260K``); a fine-tuned model's id is
``<base model name>:ft:<job id>``, the ``fine_tuned_model`` of its fine-tuning job. Each is
``{"id", "object": "model", "created", "owned_by"}``: a base model is owned by its source
(``hf``, ``local``, ``llama2c``), a fine-tuned one by the organization its job names.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.store import repo
from app.store.schema import JobState
from app.web.deps import get_engine
from app.web.errors import ApiError

router = APIRouter(prefix="/v1")
#: ``organization_id`` of every fine-tuning job, and ``owned_by`` of its fine-tuned model.
ORGANIZATION = "whetstone"


def fine_tuned_model_id(model_name: str, run_id: str) -> str:
    """The id of the model a succeeded run produced, e.g. ``stories260K:ft:ftjob-3f9a…``."""
    return f"{model_name}:ft:{run_id}"


def _object(model_id: str, created: float, owned_by: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": owned_by}


def _fine_tuned(run, job, model_name: str) -> dict[str, Any]:
    return _object(fine_tuned_model_id(model_name, run.id), job.finished_at or run.created_at,
                   ORGANIZATION)


@router.get("/models")
def list_models(request: Request):
    engine = get_engine(request)
    models = repo.list_models(engine)
    names = {m.id: m.name for m in models}
    data = [_object(m.name, m.created_at, m.source) for m in models]
    data += [_fine_tuned(run, job, names.get(run.model_id, run.model_id))
             for run, job in repo.succeeded_runs(engine)]
    return {"object": "list", "data": data}


@router.get("/models/{model_id}")
def retrieve_model(request: Request, model_id: str):
    engine = get_engine(request)
    models = repo.list_models(engine)
    for m in models:
        if m.name == model_id:
            return _object(m.name, m.created_at, m.source)
    base, sep, run_id = model_id.rpartition(":ft:")
    if sep:
        try:
            run, job = repo.run_with_job(engine, run_id)
        except repo.NotFound:
            run, job = None, None
        names = {m.id: m.name for m in models}
        if run is not None and job is not None and job.state == JobState.SUCCEEDED \
                and names.get(run.model_id, run.model_id) == base:
            return _fine_tuned(run, job, base)
    raise ApiError(404, f"The model {model_id!r} does not exist: GET /v1/models lists the base "
                        "models and the fine-tuned models of succeeded jobs", "model",
                   "model_not_found")
