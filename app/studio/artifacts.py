"""What users are shown of a run's artifacts (``/api`` run reads, ``/v1`` result files): only
those whose file or folder is still on disk, and never a server filesystem path (the database
row keeps ``path`` and the worker's ``meta`` paths for the server's own use)."""
from __future__ import annotations

import os
import re
from pathlib import PurePath
from typing import Any

from sqlalchemy.engine import Engine

from app.store import repo
from app.store.schema import Artifact, Model


def checkpoint_step(art: Artifact) -> int | None:
    """The step of a trainer checkpoint ``art`` still on disk, its folder holding an adapter
    (``adapter_config.json``); None for another kind of artifact or a checkpoint the trainer
    rotated away. The one test of "on disk" that exports, resumes, checkpoint evals, the
    Playground and the checkpoint downloads share."""
    step = (art.meta or {}).get("step")
    if art.kind != "checkpoint" or not isinstance(step, int):
        return None
    return step if os.path.isfile(os.path.join(art.path, "adapter_config.json")) else None


def present(engine: Engine, run_id: str, kind: str | None = None) -> list[Artifact]:
    """The run's artifacts (of ``kind``), oldest first, whose file or folder still exists: a
    checkpoint the trainer rotated away, or a file removed by hand, is not listed."""
    return [a for a in repo.list_artifacts(engine, run_id, kind) if os.path.exists(a.path)]


def is_server_path(value: Any) -> bool:
    """Whether ``value`` is a string naming a server filesystem path (absolute, or ``~``)."""
    return isinstance(value, str) and (os.path.isabs(value) or value.startswith("~"))


def without_server_paths(value: Any, folder: str | None = None) -> Any:
    """``value`` (a JSON-like record: dicts, lists, scalars) as members see it: every string
    that is a server path (:func:`is_server_path`) becomes its part below the last component
    named ``folder`` (an export's ``export-11``: ``/data/exports/export-11/adapter`` ->
    ``adapter``; the folder itself -> ``.``), else its last component (a file name). Other
    values are returned as they are; ``value`` is not changed."""
    if isinstance(value, dict):
        return {k: without_server_paths(v, folder) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_server_paths(v, folder) for v in value]
    if not is_server_path(value):
        return value
    parts = PurePath(value).parts
    if folder in parts:
        below = parts[len(parts) - parts[::-1].index(folder):]
        return "/".join(below) or "."
    return parts[-1] if parts else value


def base_model_id(model: Model) -> str:
    """How an adapter names its base outside the studio: the Hub id for ``hf`` models (without
    the ``@revision`` a pinned one is registered with: PEFT and the Hub take the bare id, as
    ``worker/export/provenance.py`` writes it), else the registered name (never a server
    path)."""
    if model.source == "hf" and model.source_ref:
        return model.source_ref.partition("@")[0]
    return model.name


def portable_text(text: str, server_paths: list[str], public_id: str) -> str:
    """``text`` (a model card, ``adapter_config.json``...) with every path that starts with one
    of ``server_paths`` (absolute folders: the base's folder, the data dir) replaced by
    ``public_id``: ``base_model: /data/models/x`` and the tag ``base_model:adapter:/data/...``
    PEFT writes into a checkpoint's card name the base as :func:`base_model_id` does."""
    roots = sorted({p.rstrip("/") for p in server_paths if is_server_path(p)}, key=len,
                   reverse=True)
    if not roots:
        return text
    # a root counts only as a whole path component: "/data" is not replaced in "/database"
    pattern = "(?:" + "|".join(re.escape(r) for r in roots) + \
        r")(?=[/\s\"'`,\]\)]|$)(?:/[^\s\"'`,\]\)]*)?"
    return re.sub(pattern, lambda _: public_id, text)


def public(art: Artifact) -> dict[str, Any]:
    """``art`` as JSON for users: its row without ``path``, ``meta`` without values that are
    server paths (e.g. the adapter's ``folder``), and ``download_url``: a file's own; a trainer
    checkpoint's folder as one zip (``/api/runs/<run>/checkpoints/<step>/download``, add
    ``?state=true`` for the optimizer/scheduler/RNG state); None for another folder."""
    out = art.model_dump(mode="json", exclude={"path"})
    if art.meta:
        out["meta"] = {k: v for k, v in art.meta.items() if not is_server_path(v)}
    step = checkpoint_step(art)
    if os.path.isfile(art.path):
        out["download_url"] = f"/artifacts/{art.id}/download"
    elif step is not None:
        out["download_url"] = f"/api/runs/{art.run_id}/checkpoints/{step}/download"
    else:
        out["download_url"] = None
    return out
