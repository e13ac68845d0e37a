"""What users are shown of a run's artifacts (``/api`` run reads, ``/v1`` result files): only
those whose file or folder is still on disk, and never a server filesystem path (the database
row keeps ``path`` and the worker's ``meta`` paths for the server's own use)."""
from __future__ import annotations

import os
from typing import Any

from sqlalchemy.engine import Engine

from app.store import repo
from app.store.schema import Artifact


def present(engine: Engine, run_id: str, kind: str | None = None) -> list[Artifact]:
    """The run's artifacts (of ``kind``), oldest first, whose file or folder still exists: a
    checkpoint the trainer rotated away, or a file removed by hand, is not listed."""
    return [a for a in repo.list_artifacts(engine, run_id, kind) if os.path.exists(a.path)]


def is_server_path(value: Any) -> bool:
    """Whether ``value`` is a string naming a server filesystem path (absolute, or ``~``)."""
    return isinstance(value, str) and (os.path.isabs(value) or value.startswith("~"))


def public(art: Artifact) -> dict[str, Any]:
    """``art`` as JSON for users: its row without ``path``, ``meta`` without values that are
    server paths (e.g. the adapter's ``folder``), and ``download_url``: a file's own; a trainer
    checkpoint's folder as one zip (``/api/runs/<run>/checkpoints/<step>/download``, add
    ``?state=true`` for the optimizer/scheduler/RNG state); None for another folder."""
    out = art.model_dump(mode="json", exclude={"path"})
    if art.meta:
        out["meta"] = {k: v for k, v in art.meta.items() if not is_server_path(v)}
    step = (art.meta or {}).get("step")
    if os.path.isfile(art.path):
        out["download_url"] = f"/artifacts/{art.id}/download"
    elif art.kind == "checkpoint" and isinstance(step, int) and os.path.isdir(art.path):
        out["download_url"] = f"/api/runs/{art.run_id}/checkpoints/{step}/download"
    else:
        out["download_url"] = None
    return out
