"""The OpenAI Files API under /v1: uploads (``purpose="fine-tune"``) are our datasets (``file-…``).

Every dataset format the studio reads is accepted, and GRPO prompt files (GSM8K rows, OpenAI RFT
rows whose messages end on a user turn) for reinforcement jobs; a file that cannot be used is
refused with an OpenAI-shaped 400 naming the row and field. A job's ``result_files`` (``art-…``:
the adapter zip, config.json) can be retrieved and downloaded here too.
"""
from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from app.data.errors import DatasetError
from app.store import repo
from app.store.schema import Artifact, Dataset
from app.web.deps import get_engine, get_settings
from app.web.errors import ApiError
from app.web.services import is_under, upload_dataset
from app.web.uploads import UploadError

router = APIRouter(prefix="/v1")


def file_object(ds: Dataset) -> dict[str, Any]:
    return {"id": ds.id, "object": "file", "bytes": ds.bytes, "created_at": int(ds.created_at),
            "filename": ds.filename, "purpose": ds.purpose, "status": ds.status,
            "status_details": ds.error, "expires_at": None}


@router.post("/files")
async def create_file(request: Request):
    try:
        ds, _ = await upload_dataset(request, get_settings(request), get_engine(request),
                                     purpose_required=True, prompts_fallback=True)
    except UploadError as exc:
        raise ApiError(exc.status, exc.message, exc.param, "invalid_file") from None
    except DatasetError as exc:
        raise ApiError(400, f"invalid training file: {exc}", "file", "invalid_file") from None
    return file_object(ds)


@router.get("/files")
def list_files(request: Request, purpose: str | None = None, limit: int = 10000,
               after: str | None = None, order: str = "desc"):
    items = repo.list_datasets(get_engine(request), limit=max(1, min(limit, 10000)) + 1000)
    if purpose:
        items = [d for d in items if d.purpose == purpose]
    if order == "asc":
        items.reverse()
    if after:
        ids = [d.id for d in items]
        items = items[ids.index(after) + 1:] if after in ids else items
    page = items[:limit]
    return {"object": "list", "data": [file_object(d) for d in page],
            "has_more": len(items) > len(page),
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


def result_file_object(art: Artifact) -> dict[str, Any]:
    """A job's result file (``result_files`` of a fine-tuning job: the adapter zip, config.json)."""
    return {"id": art.id, "object": "file", "bytes": art.bytes, "created_at": int(art.created_at),
            "filename": os.path.basename(art.path), "purpose": "fine-tune-results",
            "status": "processed", "status_details": None, "expires_at": None}


@router.get("/files/{file_id}")
def retrieve_file(request: Request, file_id: str):
    art = _result_file(request, file_id)
    return result_file_object(art) if art else file_object(_dataset(request, file_id))


@router.get("/files/{file_id}/content")
def file_content(request: Request, file_id: str):
    art = _result_file(request, file_id)
    path, name = (art.path, os.path.basename(art.path)) if art else \
        ((ds := _dataset(request, file_id)).path, ds.filename)
    if not is_under(path, get_settings(request).data_dir) or not os.path.isfile(path):
        raise ApiError(404, f"the content of file {file_id} is not available", "file_id")
    return FileResponse(path, filename=name, media_type="application/octet-stream")


def _result_file(request: Request, file_id: str) -> Artifact | None:
    """The artifact behind a ``result_files`` id (``art-…``), else None (a dataset id)."""
    if not file_id.startswith("art-"):
        return None
    try:
        return repo.get_artifact(get_engine(request), file_id)
    except repo.NotFound:
        raise ApiError(404, f"No such File object: {file_id}", "id", "file_not_found") from None


@router.delete("/files/{file_id}")
def delete_file(request: Request, file_id: str):
    engine, settings = get_engine(request), get_settings(request)
    ds = _dataset(request, file_id)
    try:
        repo.delete_dataset(engine, ds.id)
    except repo.InUse as exc:
        raise ApiError(409, str(exc), "file_id", "file_in_use") from None
    if is_under(ds.path, settings.data_dir / "uploads"):
        try:
            os.unlink(ds.path)
        except OSError:
            pass
    return {"id": ds.id, "object": "file", "deleted": True}


def _dataset(request: Request, file_id: str) -> Dataset:
    try:
        return repo.get_dataset(get_engine(request), file_id)
    except repo.NotFound:
        raise ApiError(404, f"No such File object: {file_id}", "id", "file_not_found") from None


# ---- fine-tuning jobs -------------------------------------------------------------------
