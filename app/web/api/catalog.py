"""Native JSON API for datasets, models and the GRPO reward catalog."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from app.store.specs import CUSTOM_REWARD_SIGNATURE, REWARD_DESCRIPTIONS, REWARD_NAMES
from app.studio import access
from app.studio import datasets as datasets_uc
from app.studio import models as models_uc
from app.studio.grpo import custom_rewards_allowed
from app.web.api.schemas import (DatasetList, DatasetOut, ModelDeleted, ModelList, ModelOut,
                                 dataset_out, json_object, model_out)
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.uploads import receive_upload

router = APIRouter(prefix="/api", tags=["datasets and models"])


@router.get("/datasets", response_model=DatasetList)
def list_datasets(engine: EngineDep, user: CurrentUser):
    return DatasetList(data=[dataset_out(d) for d in datasets_uc.list_datasets(engine, user)])


@router.get("/datasets/{dataset_id}", response_model=DatasetOut)
def get_dataset(dataset_id: str, engine: EngineDep, user: CurrentUser):
    return dataset_out(access.dataset(engine, user, dataset_id))


@router.delete("/datasets/{dataset_id}", response_model=DatasetOut)
def delete_dataset(dataset_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """Delete a dataset and its file (409 while a queued or running job of a run uses it);
    runs that used it keep naming it, "(deleted)" (app.studio.datasets.delete_dataset)."""
    return dataset_out(datasets_uc.delete_dataset(engine, settings, user, dataset_id))


@router.post("/grpo/datasets", status_code=201, response_model=DatasetOut)
async def upload_prompts(request: Request, engine: EngineDep, settings: SettingsDep,
                         user: CurrentUser):
    """Upload a GRPO prompt dataset (multipart ``file``; optional ``prompt_column`` and
    ``answer_column`` form fields)."""
    up = await receive_upload(request, settings.data_dir / "uploads", settings.max_upload_mb)
    ds = await run_in_threadpool(
        datasets_uc.record_prompt_upload, engine, settings, user, up.take(),
        up.filename or "prompts.jsonl", up.bytes, up.fields.get("prompt_column"),
        up.fields.get("answer_column"))
    return dataset_out(ds)


@router.get("/models", response_model=ModelList)
def list_models(engine: EngineDep, user: CurrentUser):
    return ModelList(data=[model_out(m, user) for m in models_uc.list_models(engine, user)])


@router.post("/models", status_code=201, response_model=ModelOut)
async def create_model(request: Request, engine: EngineDep, settings: SettingsDep,
                       user: CurrentUser):
    """Register a model: ``{"source": "hf", "hf_id"}``, ``{"source": "local", "folder"}`` or
    ``{"source": "llama2c", "checkpoint", "tokenizer"}``, optional ``name``."""
    body = await json_object(request)
    data = {k: str(v) for k, v in body.items() if v is not None}
    return model_out(models_uc.register_model(engine, settings, user, data), user)


@router.get("/models/{model_id}", response_model=ModelOut)
def get_model(model_id: str, engine: EngineDep, user: CurrentUser):
    """One model the caller may use, as ``GET /api/models`` lists it (404 otherwise)."""
    return model_out(access.model(engine, user, model_id), user)


@router.delete("/models/{model_id}", response_model=ModelDeleted)
def remove_model(model_id: str, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """Delete a model no run uses (409 otherwise)."""
    model = models_uc.delete_model(engine, settings, user, model_id)
    return ModelDeleted(id=model.id, name=model.name)


@router.get("/grpo/rewards")
def reward_catalog(user: CurrentUser):
    """The reward functions a run may use, the custom signature, and whether the caller may run
    custom reward code."""
    return {"rewards": [{"name": n, "description": REWARD_DESCRIPTIONS[n]} for n in REWARD_NAMES],
            "custom_signature": CUSTOM_REWARD_SIGNATURE,
            "custom_allowed": custom_rewards_allowed(user)}
