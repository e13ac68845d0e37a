"""The OpenAI Files API under /v1: uploads (``purpose="fine-tune"``) are our datasets (``file-…``).

Every dataset format the studio reads is accepted, and GRPO prompt files (GSM8K rows, OpenAI RFT
rows whose messages end on a user turn) for reinforcement jobs; a file that cannot be used is
refused with an OpenAI-shaped 400 naming the row and field. A job's ``result_files`` (``art-…``:
the adapter zip, config.json) can be retrieved and downloaded here too. Each caller sees only
their own files (an admin: everyone's).
"""
from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from app.store.schema import Artifact, Dataset
from app.studio import access
from app.studio import datasets as datasets_uc
from app.studio.datasets import is_under
from app.studio.paging import after_cursor, page_limit, page_order
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.errors import ApiError
from app.web.openai.shapes import file_object, result_file_object
from app.web.uploads import UploadError, receive_upload

router = APIRouter(prefix="/v1")


def _missing(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", "id", "file_not_found")


@router.post("/files")
async def create_file(request: Request, engine: EngineDep, settings: SettingsDep,
                      user: CurrentUser):
    up = await receive_upload(request, settings.data_dir / "uploads", settings.max_upload_mb)
    if up.fields.get("purpose", "fine-tune") != "fine-tune":
        up.discard()
        raise UploadError(f"purpose {up.fields.get('purpose')!r} is not supported; use "
                          "'fine-tune'", 400, "purpose")
    try:
        ds = await run_in_threadpool(datasets_uc.record_upload, engine, settings, user, up.take(),
                                     up.filename or "upload", up.bytes, prompts_fallback=True)
    except StudioError as exc:
        if exc.kind != "invalid":
            raise
        raise ApiError(400, f"invalid training file: {exc.message}", "file", "invalid_file") from None
    return file_object(ds)


@router.get("/files")
def list_files(engine: EngineDep, user: CurrentUser, purpose: str | None = None,
               limit: str | None = None, after: str | None = None, order: str | None = None):
    limit = page_limit(limit, 10000, 10000)
    order = page_order(order)
    items = datasets_uc.list_datasets(engine, user, limit=limit + 1000)
    if purpose:
        items = [d for d in items if d.purpose == purpose]
    if order == "asc":
        items.reverse()
    items = after_cursor(items, [d.id for d in items], after, "file")
    page = items[:limit]
    return {"object": "list", "data": [file_object(d) for d in page],
            "has_more": len(items) > len(page),
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


def _file(engine, user, file_id: str) -> Artifact | Dataset:
    """The artifact (``art-…``, a job's result file) or dataset behind ``file_id`` that the
    caller may see. Raises ApiError 404."""
    try:
        if file_id.startswith("art-"):
            return access.artifact(engine, user, file_id)
        return access.dataset(engine, user, file_id)
    except StudioError:
        raise _missing(file_id) from None


@router.get("/files/{file_id}")
def retrieve_file(file_id: str, engine: EngineDep, user: CurrentUser):
    obj = _file(engine, user, file_id)
    return result_file_object(obj) if isinstance(obj, Artifact) else file_object(obj)


@router.get("/files/{file_id}/content")
def file_content(file_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    obj = _file(engine, user, file_id)
    name = os.path.basename(obj.path) if isinstance(obj, Artifact) else obj.filename
    if not is_under(obj.path, settings.data_dir) or not os.path.isfile(obj.path):
        raise ApiError(404, f"the content of file {file_id} is not available", "file_id")
    datasets_uc.downloaded(engine, user, "artifact" if isinstance(obj, Artifact) else "dataset",
                           obj.id, name=name)
    return FileResponse(obj.path, filename=name, media_type="application/octet-stream")


@router.delete("/files/{file_id}")
def delete_file(file_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    if file_id.startswith("art-"):
        _file(engine, user, file_id)
        raise ApiError(400, "a job's result file cannot be deleted", "file_id", "invalid_value")
    try:
        ds = datasets_uc.delete_dataset(engine, settings, user, file_id)
    except StudioError as exc:
        if exc.kind == "not_found":
            raise _missing(file_id) from None
        raise ApiError(409, exc.message, "file_id", "file_in_use") from None
    return {"id": ds.id, "object": "file", "deleted": True}
