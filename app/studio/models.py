"""Models: registering one (Hub id, local HF folder, llama2.c checkpoint), listing, deleting.

A model belongs to the user who registered it; the seeded demo model is shared (everyone may
train on it; only an admin may delete it). Local paths on the server are accepted only under
the import root (``WHETSTONE_IMPORT_ROOT``; an admin may name any path), so the model form is
no way to probe the server's files.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from app.settings import Settings
from app.store import queue, repo
from app.store.schema import Model
from app.studio import access, audit
from app.studio.datasets import is_under
from app.studio.errors import FieldErrors, StudioError

if TYPE_CHECKING:
    from app.store.schema import User

_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")


class ModelFormError(FieldErrors):
    """Field problems of a model registration (kind ``invalid``): ``fields`` maps each bad
    field to its message; the first is the error's ``field``/``message``."""


def list_models(engine: Engine, actor: User) -> list[Model]:
    """The models ``actor`` may use: own and shared ones (all for an admin), oldest first."""
    return repo.list_models(engine, owner=access.owner_filter(actor))


def usable_models(engine: Engine, actor: User) -> list[Model]:
    """The models ``actor`` may train on, pick in a form or list under ``/v1/models``: those of
    :func:`list_models` whose import has not failed (a ``pending`` one is kept: a run on it
    waits for the import). The one rule every surface uses; the Models page lists all."""
    return [m for m in list_models(engine, actor) if m.status != "failed"]


def _local_path(settings: Settings, actor: User, value: str, what: str) -> str | None:
    """Why the server path ``value`` may not be used by ``actor``, else None. Never reads it."""
    if access.is_admin(actor):
        return None
    root = settings.import_root
    if root is None or str(root) == "":
        return (f"{what} on the server are not available to members (an admin can set "
                "WHETSTONE_IMPORT_ROOT); register a Hugging Face id instead")
    if not is_under(value, root):
        return f"only paths under the import root {root} may be used"
    return None


def register_model(engine: Engine, settings: Settings, actor: User, data: dict) -> Model:
    """Validate a registration (``source`` hf|local|llama2c and its fields) and queue the import;
    the model belongs to ``actor``.

    Raises:
        ModelFormError: naming each bad field (a path outside the import root included; no
            message ever shows a file's content).
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
        why = _local_path(settings, actor, folder, "folders") if folder else None
        if not folder:
            errors["folder"] = "enter the path of a folder holding config.json and the weights"
        elif why:
            errors["folder"] = why
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
            why = _local_path(settings, actor, val, "files") if val else None
            if not val:
                errors[key] = f"enter the path of the llama2.c {what} .bin"
            elif why:
                errors[key] = why
            elif not os.path.isfile(val):
                errors[key] = f"no file at {val}"
        ref = f"{os.path.abspath(ckpt)}|{os.path.abspath(tok)}" if ckpt and tok else ""
        name = name or os.path.splitext(os.path.basename(ckpt or "model"))[0]
    else:
        errors["source"] = "choose hf, local or llama2c"
    if name and not _NAME.match(name):
        errors["name"] = "use letters, digits, '.', '_', '-' or ':' (at most 100)"
    if not errors and name:
        taken = [m for m in repo.models_named(engine, name)  # names are unique per owner
                 if m.name == name and (m.owner == actor.id or m.shared)]
        if taken:
            errors["name"] = (f"you already have a model named {name!r}" if not taken[0].shared
                              else f"{name!r} is the name of a shared model; choose another")
    if errors:
        raise ModelFormError(errors)
    try:
        model = repo.add_model(engine, Model(name=name, source=source, source_ref=ref,
                                             owner=actor.id))
    except IntegrityError:
        raise ModelFormError({"name": f"you already have a model named {name!r}"}) from None
    audit.record(engine, actor.id, "model.registered", "model", model.id, name=name,
                 source=source)
    return model


def delete_model(engine: Engine, settings: Settings, actor: User, model_id: str) -> Model:
    """Delete a model (by id or name) that no run uses, and its prepared folder under the data
    dir; a shared model only by its owner or an admin.

    Raises:
        StudioError: not_found (unknown, or not the actor's); conflict when a run uses it or it is
            still being imported (the message says which).
    """
    model = access.model(engine, actor, model_id, write=True)
    try:
        repo.delete_model(engine, model.id)
    except repo.NotFound:
        raise StudioError("not_found", f"no model {model_id!r} is registered") from None
    except repo.InUse as exc:
        raise StudioError("conflict", str(exc), "model_id", "model_in_use") from None
    if model.path and is_under(model.path, settings.data_dir) and os.path.isdir(model.path):
        shutil.rmtree(Path(model.path), ignore_errors=True)
    audit.record(engine, actor.id, "model.deleted", "model", model.id, name=model.name)
    return model


def retry_import(engine: Engine, actor: User, model_id: str) -> Model:
    """Queue the import of a model whose import failed once more (its owner or an admin): the
    model goes back to ``pending`` with its error cleared.

    Raises:
        StudioError: not_found (unknown, or not the actor's to change); conflict when the model
            is not failed (pending or ready: nothing to retry).
    """
    model = access.model(engine, actor, model_id, write=True)
    if model.status != "failed":
        raise StudioError("conflict", f"model {model.name!r} is {model.status}; only a failed "
                                      "import can be retried", "model_id")
    model = repo.update_model(engine, model.id, status="pending", error=None)
    queue.enqueue(engine, "import_model", {"spec_version": 1, "model_id": model.id},
                  priority=10, owner=model.owner)
    audit.record(engine, actor.id, "model.import_retried", "model", model.id, name=model.name)
    return model
