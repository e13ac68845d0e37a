"""Artifact downloads: files a job produced, served only from under the data dir, only to the
run's owner (or an admin)."""
from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from app.studio import access
from app.studio import checkpoint_files
from app.studio import datasets as datasets_uc
from app.studio import exports as exports_uc
from app.studio.datasets import is_under
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.downloads import zip_stream

router = APIRouter()


@router.get("/artifacts/{artifact_id}/download")
def download(artifact_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    art = access.artifact(engine, user, artifact_id)
    if not is_under(art.path, settings.data_dir) or not os.path.isfile(art.path):
        raise StudioError("not_found", f"the file of artifact {artifact_id} is missing")
    datasets_uc.downloaded(engine, user, "artifact", art.id, run=art.run_id, name=art.name)
    media = "application/zip" if art.path.endswith(".zip") else (
        "application/json" if art.path.endswith(".json") else "application/octet-stream")
    name = exports_uc.download_name(engine, art.run_id, Path(art.name).name)
    return FileResponse(art.path, filename=name, media_type=media)


@router.get("/runs/{run_id}/checkpoints/{step}/download")
async def download_checkpoint(run_id: str, step: str, engine: EngineDep, settings: SettingsDep,
                              user: CurrentUser, state: bool = False):
    """Checkpoint ``step`` of the run as one zip streamed as it is built (the adapter and
    tokenizer files; the trainer's resume state too with ``?state=true``)."""
    name, chunks = await run_in_threadpool(checkpoint_files.archive, engine, settings, user,
                                           run_id, step, state)
    return zip_stream(name, chunks)
