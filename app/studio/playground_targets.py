"""The playground's model picker: what a user may chat with, each entry labelled so that no two
read alike.

A closed ``<select>`` shows only the chosen option's text, not its group, so every label names
its run: ``<run> · final adapter``, ``<run> · checkpoint 40``, ``<run> · GGUF Q4_K_M · export
12, 12-01 22:05`` (a GGUF export of a checkpoint says ``GGUF Q4_K_M of checkpoint 40``). A run
is named by its name; when several listed runs share a name (or have none), each also gets its
short id and creation date (``alpaca [3f9a1c, 12-01 22:05]``, :mod:`app.studio.run_labels`).
Group labels carry the run's name, base model, creation date and short id.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store import repo
from app.store.db import session_scope
from app.store.schema import Artifact, Job, JobState, Run
from app.store.specs import GGUF_TYPES
from app.studio import access
from app.studio import checkpoint_eval as ckpt_eval
from app.studio.run_labels import run_tags, short_date, short_id

if TYPE_CHECKING:
    from app.store.schema import User

#: The runs the picker lists (newest first).
RUNS_LISTED = 50


def gguf_type(a: Artifact) -> str:
    """The GGUF type of an exported file, from its name ``<name>-<TYPE>.gguf``; else the
    export's one requested type; else ``"file " + its name``."""
    stem = a.name[:-5] if a.name.lower().endswith(".gguf") else a.name
    tail = stem.rsplit("-", 1)[-1].upper()
    if tail in GGUF_TYPES:
        return tail
    asked = (a.meta or {}).get("quantization") or []
    return asked[0] if len(asked) == 1 else f"file {a.name}"


def _export_steps(engine: Engine, job_ids: set[int]) -> dict[int, int | None]:
    """Export job id -> the checkpoint step it exported (None: the final adapter)."""
    if not job_ids:
        return {}
    with session_scope(engine) as s:
        return {j.id: (j.payload or {}).get("checkpoint_step")
                for j in s.exec(select(Job).where(Job.id.in_(job_ids)))}


def targets(engine: Engine, actor: User) -> list[dict[str, Any]]:
    """What ``actor`` may chat with, for the page's picker: ``{"model", "label", "group"}``
    for each ready base model, each finished run's final adapter, each run's checkpoints still
    on disk and GGUF exports (newest runs first), labelled as the module docstring says."""
    out = [{"model": m.name, "label": f"{m.name} (base model)", "group": "Base models"}
           for m in repo.list_models(engine, owner=access.owner_filter(actor))
           if m.status == "ready"]
    names = {m.id: m.name for m in repo.list_models(engine)}
    runs = repo.list_runs(engine, RUNS_LISTED, owner=access.owner_filter(actor))
    tags = run_tags(runs)
    for run in runs:
        _, job = repo.run_with_job(engine, run.id)
        base = f"{names.get(run.model_id, run.model_id)}:ft:{run.id}"
        tag = tags[run.id]
        group = (f"{run.name or 'unnamed run'} ({names.get(run.model_id, '?')}) · "
                 f"{short_date(run.created_at)} · {short_id(run.id)}")
        if job is not None and job.state == JobState.SUCCEEDED:
            out.append({"model": base, "label": f"{tag} · final adapter", "group": group})
        for step in ckpt_eval.checkpoint_steps(engine, run.id):
            out.append({"model": f"{base}:checkpoint-{step}",
                        "label": f"{tag} · checkpoint {step}", "group": group})
        files = repo.list_artifacts(engine, run.id, kind="gguf")
        steps = _export_steps(engine, {a.job_id for a in files if a.job_id is not None})
        for a in files:
            step = steps.get(a.job_id)
            of = f" of checkpoint {step}" if step else ""
            export = f"export {a.job_id}, " if a.job_id is not None else ""
            out.append({"model": f"{base}:{a.id}",
                        "label": (f"{tag} · GGUF {gguf_type(a)}{of} · {export}"
                                  f"{short_date(a.created_at)} (llama.cpp)"),
                        "group": group})
    return out


def run_link(engine: Engine, run: Run, job: Job | None) -> dict[str, str] | None:
    """Where a run page's playground link goes: ``{"model", "label"}`` or None for no link.

    A succeeded run chats with its final adapter (``<model>:ft:<run>``, "Open in
    playground"); a cancelled or failed one with its newest checkpoint still on disk
    (``<model>:ft:<run>:checkpoint-<step>``, "Open checkpoint-<step> in playground"), since
    it has no final adapter; a run still queued or running, or one that ended before it saved
    a checkpoint, has nothing to chat with (None). The model ids are the ones
    :func:`app.studio.playground` resolves."""
    if job is None or job.state in (JobState.QUEUED, JobState.RUNNING):
        return None
    try:
        model = repo.get_model(engine, run.model_id).name
    except repo.NotFound:
        return None  # its base model is gone: the playground could not load it
    base = f"{model}:ft:{run.id}"
    if job.state == JobState.SUCCEEDED:
        return {"model": base, "label": "Open in playground"}
    steps = ckpt_eval.checkpoint_steps(engine, run.id)
    if not steps:
        return None
    return {"model": f"{base}:checkpoint-{steps[0]}",
            "label": f"Open checkpoint-{steps[0]} in playground"}
