"""Models: list with status and register from a Hub id, a local folder or a llama2.c checkpoint."""
from __future__ import annotations

import os
import re

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse
from sqlalchemy.exc import IntegrityError

from app.store import repo
from app.store.schema import Model
from app.web.deps import get_engine, get_settings, is_htmx
from app.web.render import render
from app.web.services import delete_model

router = APIRouter()
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelFormError(Exception):
    """Field problems of a model registration: ``errors`` maps field → message."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def register_model(engine, data: dict) -> Model:
    """Validate a registration (``source`` hf|local|llama2c and its fields) and queue the import.

    Raises:
        ModelFormError: naming each bad field.
    """
    source = (data.get("source") or "hf").strip()
    name = (data.get("name") or "").strip()
    errors: dict[str, str] = {}
    ref = ""
    if source == "hf":
        hf_id = (data.get("hf_id") or data.get("source_ref") or "").strip()
        if not hf_id:
            errors["hf_id"] = "enter a Hugging Face model id such as Qwen/Qwen2.5-0.5B-Instruct"
        elif not _HF_ID.match(hf_id):
            errors["hf_id"] = "a Hugging Face id looks like owner/name"
        ref = hf_id
        name = name or hf_id.split("/")[-1]
    elif source == "local":
        folder = (data.get("folder") or data.get("source_ref") or "").strip()
        if not folder:
            errors["folder"] = "enter the path of a folder holding config.json and the weights"
        elif not os.path.isdir(folder):
            errors["folder"] = f"no folder at {folder}"
        elif not os.path.isfile(os.path.join(folder, "config.json")):
            errors["folder"] = "the folder has no config.json (not a Hugging Face model folder)"
        ref = os.path.abspath(folder) if folder else ""
        name = name or os.path.basename(os.path.normpath(folder or "model"))
    elif source == "llama2c":
        ckpt = (data.get("checkpoint") or "").strip()
        tok = (data.get("tokenizer") or "").strip()
        if not ckpt and data.get("source_ref") and "|" in data["source_ref"]:
            ckpt, tok = (p.strip() for p in data["source_ref"].split("|", 1))
        for key, val, what in (("checkpoint", ckpt, "checkpoint"), ("tokenizer", tok, "tokenizer")):
            if not val:
                errors[key] = f"enter the path of the llama2.c {what} .bin"
            elif not os.path.isfile(val):
                errors[key] = f"no file at {val}"
        ref = f"{os.path.abspath(ckpt)}|{os.path.abspath(tok)}" if ckpt and tok else ""
        name = name or os.path.splitext(os.path.basename(ckpt or "model"))[0]
    else:
        errors["source"] = "choose hf, local or llama2c"
    if name and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$", name):
        errors["name"] = "use letters, digits, '.', '_', '-' or ':' (at most 100)"
    if not errors and name:
        try:
            repo.get_model(engine, name)
            errors["name"] = f"a model named {name!r} is already registered"
        except repo.NotFound:
            pass
    if errors:
        raise ModelFormError(errors)
    try:
        return repo.add_model(engine, Model(name=name, source=source, source_ref=ref))
    except IntegrityError:
        raise ModelFormError({"name": f"a model named {name!r} is already registered"}) from None


@router.get("/models")
def models_page(request: Request):
    return render(request, "models.html", {"models": repo.list_models(get_engine(request)),
                                           "form": {}, "errors": {}}, block="model_list")


@router.post("/models")
async def register(request: Request):
    engine = get_engine(request)
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    try:
        model = register_model(engine, form)
    except ModelFormError as exc:
        return render(request, "models.html", {"models": repo.list_models(engine), "form": form,
                                               "errors": exc.errors,
                                               "form_error": "Please fix the fields marked below."},
                      block="register_form", status_code=422)
    if is_htmx(request):
        return render(request, "models.html", {"models": repo.list_models(engine), "form": {},
                                               "errors": {}, "registered": model.name},
                      block="register_form", headers={"HX-Trigger": "model-registered"})
    return RedirectResponse("/models", status_code=303)


@router.post("/models/{model_id}/delete")
def delete(request: Request, model_id: str):
    """Delete a model (the page asks first); 409 with the reason when runs use it."""
    engine = get_engine(request)
    try:
        model = delete_model(engine, get_settings(request), model_id)
    except repo.InUse as exc:
        return render(request, "models.html", {"models": repo.list_models(engine), "form": {},
                                               "errors": {}, "list_error": str(exc)},
                      block="model_list", status_code=409)
    if is_htmx(request):
        return render(request, "models.html", {"models": repo.list_models(engine), "form": {},
                                               "errors": {}, "deleted": model.name},
                      block="model_list")
    return RedirectResponse("/models", status_code=303)
