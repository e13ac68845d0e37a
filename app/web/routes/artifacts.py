"""Artifact downloads: files a job produced, served only from under the data dir."""
from __future__ import annotations

from pathlib import Path

import os

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from app.store import repo
from app.web.deps import get_engine, get_settings
from app.web.errors import ApiError
from app.web.services import is_under

router = APIRouter()


@router.get("/artifacts/{artifact_id}/download")
def download(request: Request, artifact_id: str):
    art = repo.get_artifact(get_engine(request), artifact_id)
    if not is_under(art.path, get_settings(request).data_dir):
        raise ApiError(404, f"artifact {artifact_id} is not stored under the data dir")
    if not os.path.isfile(art.path):
        raise ApiError(404, f"the file of artifact {artifact_id} is missing")
    media = "application/zip" if art.path.endswith(".zip") else (
        "application/json" if art.path.endswith(".json") else "application/octet-stream")
    return FileResponse(art.path, filename=Path(art.name).name, media_type=media)
