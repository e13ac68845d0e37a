"""Native JSON API for runs: list, read, create (SFT and GRPO), cancel, resume, delete."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from app.store.specs import GrpoSpec, TrainSpec
from app.studio import access, checkpoint_files
from app.studio import grpo as grpo_runs
from app.studio import removal
from app.studio import resume as resume_uc
from app.studio import runs as runs_uc
from app.studio.paging import page_limit
from app.web.api.schemas import RunList, RunOut, json_object, run_out
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.downloads import zip_stream

router = APIRouter(prefix="/api", tags=["runs"])


@router.get("/runs", response_model=RunList)
def list_runs(engine: EngineDep, user: CurrentUser, limit: str | None = None,
              after: str | None = None):
    """The caller's runs (an admin's: everyone's), newest first; ``limit``: 1 to 1000
    (default 100; app.studio.paging)."""
    runs = runs_uc.list_runs(engine, user, limit=page_limit(limit, 100, 1000), after=after)
    return RunList(data=[run_out(engine, r) for r in runs])


@router.get("/runs/{run_id}", response_model=RunOut)
def get_run(run_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    return run_out(engine, access.run(engine, user, run_id), True, settings, user)


@router.get("/runs/{run_id}/checkpoints/{step}/download")
async def download_checkpoint(run_id: str, step: str, engine: EngineDep, settings: SettingsDep,
                              user: CurrentUser, state: bool = False):
    """Checkpoint ``step`` as a zip streamed as it is built: ``checkpoint-<step>/`` with the
    adapter, tokenizer files and model card; with ``state=true`` also the trainer's resume
    state (optimizer, scheduler, RNG, ``trainer_state.json``; not ``training_args.bin``, which
    names server paths and is not needed to resume). Text files name the base by its public id,
    never a server path. 404 for another user's run or a checkpoint not on disk (rotated away
    by ``save_total_limit``); 422 naming ``step`` for a step that is not a whole number >= 0."""
    name, chunks = await run_in_threadpool(checkpoint_files.archive, engine, settings, user,
                                           run_id, step, state)
    return zip_stream(name, chunks)


@router.post("/runs", status_code=201, response_model=RunOut)
async def create_run(request: Request, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """Create an SFT run from a TrainSpec body (plus an optional ``name``)."""
    body = await json_object(request, "a JSON object (a TrainSpec)")
    name = body.pop("name", None)
    spec = runs_uc.parse_spec(TrainSpec, body)
    run, _ = await run_in_threadpool(runs_uc.create_sft_run, engine, settings, user, spec, name)
    return run_out(engine, run, True, settings, user)


@router.post("/runs/grpo", status_code=201, response_model=RunOut)
async def create_grpo_run(request: Request, engine: EngineDep, settings: SettingsDep,
                          user: CurrentUser):
    """Create a GRPO run from a GrpoSpec body (plus an optional ``name``)."""
    body = await json_object(request, "a JSON object (a GrpoSpec)")
    name = body.pop("name", None)
    spec = runs_uc.parse_spec(GrpoSpec, body)
    run, _ = await run_in_threadpool(grpo_runs.create_grpo_run, engine, settings, user, spec,
                                      name)
    return run_out(engine, run, True, settings, user)


@router.post("/runs/{run_id}/cancel", response_model=RunOut)
def cancel_run(run_id: str, engine: EngineDep, user: CurrentUser):
    """Ask the run's job to stop; answers the run (409 when its job already ended)."""
    return run_out(engine, runs_uc.cancel_run(engine, user, run_id, if_running=True))


@router.post("/runs/{run_id}/resume", response_model=RunOut)
def resume_run(run_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """Queue a cancelled or failed run again: its new job resumes from the newest checkpoint
    (409 with the reason when it cannot: still active, succeeded, no checkpoint)."""
    run, _ = resume_uc.resume_run(engine, settings, user, run_id)
    return run_out(engine, run, True, settings, user)


@router.delete("/runs/{run_id}", response_model=RunOut)
def delete_run(run_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """Delete a run, its exports and their files; answers the deleted run (409 with the
    reason while one of its jobs is queued or running)."""
    run = access.run(engine, user, run_id)
    out = run_out(engine, run)
    removal.delete_run(engine, settings, user, run_id)
    return out
