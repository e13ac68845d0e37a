"""Native JSON API for evaluations: what a run's evaluation produced (the end of the run and
each checkpoint's on-demand eval), queueing a checkpoint's eval, reading one.

``POST /api/runs/{run_id}/checkpoints/{step}/evaluations`` (optional body ``{"samples": n}``)
queues an ``evaluate`` job (202, the eval); ``GET /api/evaluations/{id}`` answers its status and,
once it succeeded, its table; ``POST /api/evaluations/{id}/cancel`` stops one that is queued
or running (409 once it ended); ``GET /api/runs/{run_id}/evaluations`` lists everything. The rules
are in :mod:`app.studio.checkpoint_eval`.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from app.studio import checkpoint_eval as evals_uc
from app.web.api.schemas import CheckpointEvalOut, RunEvaluationsOut, json_object
from app.web.deps import CurrentUser, EngineDep, SettingsDep

router = APIRouter(prefix="/api", tags=["evaluations"])


@router.get("/runs/{run_id}/evaluations", response_model=RunEvaluationsOut)
def run_evaluations(run_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """The run's held-out set, its end-of-run eval and every checkpoint eval (newest first)."""
    return evals_uc.run_evaluations(engine, settings, user, run_id)


@router.post("/runs/{run_id}/checkpoints/{step}/evaluations", status_code=202,
             response_model=CheckpointEvalOut)
async def evaluate_checkpoint(run_id: str, step: int, request: Request, engine: EngineDep,
                              settings: SettingsDep, user: CurrentUser):
    """Queue the generation eval of checkpoint ``step`` (404: no such run or checkpoint;
    409: no held-out set, or that checkpoint's eval is already queued or running)."""
    body = await json_object(request, 'a JSON object: {"samples": n} or {}') \
        if await request.body() else {}
    job = evals_uc.queue_eval(engine, settings, user, run_id, step, body.get("samples"))
    return evals_uc.eval_info(job)


@router.get("/evaluations/{eval_id}", response_model=CheckpointEvalOut)
def get_evaluation(eval_id: int, engine: EngineDep, user: CurrentUser):
    """One checkpoint eval: status, error and (once succeeded) its table."""
    return evals_uc.eval_info(evals_uc.eval_job(engine, user, eval_id))


@router.post("/evaluations/{eval_id}/cancel", response_model=CheckpointEvalOut)
def cancel_evaluation(eval_id: int, engine: EngineDep, user: CurrentUser):
    """Stop a checkpoint eval that is queued or running (no table is written); answers the
    eval (409 when it already ended)."""
    return evals_uc.eval_info(evals_uc.cancel_eval(engine, user, eval_id))
