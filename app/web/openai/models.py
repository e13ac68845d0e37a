"""The OpenAI Models API under /v1: the base models the caller may use and the fine-tuned models
of the caller's succeeded jobs.

A base model's id is its name (``stories260K``); a fine-tuned model's id is
``<base model name>:ft:<job id>``, the ``fine_tuned_model`` of its fine-tuning job. Each is
``{"id", "object": "model", "created", "owned_by"}``: a base model is owned by its source
(``hf``, ``local``, ``llama2c``), a fine-tuned one by the organization its job names.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.store import repo
from app.studio import access
from app.studio import models as models_uc
from app.studio import playground as pg
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep
from app.web.errors import ApiError
from app.web.openai.shapes import ORGANIZATION, fine_tuned_model_id, model_object

router = APIRouter(prefix="/v1")


def _fine_tuned(run, job, model_name: str) -> dict[str, Any]:
    return model_object(fine_tuned_model_id(model_name, run.id), job.finished_at or run.created_at,
                        ORGANIZATION)


@router.get("/models")
def list_models(engine: EngineDep, user: CurrentUser):
    models = models_uc.usable_models(engine, user)
    names = {m.id: m.name for m in repo.list_models(engine)}
    data = [model_object(m.name, m.created_at, m.source) for m in models]
    data += [_fine_tuned(run, job, names.get(run.model_id, run.model_id))
             for run, job in repo.succeeded_runs(engine, owner=access.owner_filter(user))]
    return {"object": "list", "data": data}


@router.get("/models/{model_id}")
def retrieve_model(model_id: str, engine: EngineDep, user: CurrentUser):
    """A base model (listed while its import is pending too) or any id chat accepts, resolved
    by the one resolver chat uses (:func:`app.studio.playground.resolve`): a succeeded run's
    ``…:ft:<job>``, a checkpoint on disk (``…:ckpt-step-<n>`` as the checkpoints list names it,
    or ``…:checkpoint-<n>``) and a GGUF export (``…:ft:<job>:<artifact id>``). 404 otherwise."""
    for m in models_uc.usable_models(engine, user):
        if m.name == model_id:
            return model_object(m.name, m.created_at, m.source)
    try:
        t = pg.resolve(engine, user, model_id)
    except StudioError:
        t = None
    if t is None or t.run is None:
        raise ApiError(404, f"The model {model_id!r} does not exist: GET /v1/models lists the base "
                            "models and the fine-tuned models of succeeded jobs; GET /v1/fine_tuning/"
                            "jobs/{id}/checkpoints their checkpoints", "model", "model_not_found")
    if t.artifact is not None:
        created = t.artifact.created_at
    elif t.checkpoint_step is not None:
        created = next((a.created_at for a in repo.list_artifacts(engine, t.run.id, "checkpoint")
                        if (a.meta or {}).get("step") == t.checkpoint_step), t.run.created_at)
    else:
        _, job = repo.run_with_job(engine, t.run.id)
        created = (job.finished_at if job is not None else None) or t.run.created_at
    return model_object(model_id, created, ORGANIZATION)
