"""Deleting runs and exports with their files (datasets and models: ``app.studio.datasets`` and
``app.studio.models``). A delete is refused, with the reason, while a job uses the object: a
run whose training, export or other job is queued or running; an export being built or
served by a live playground session.

Rows go first (one transaction, :func:`app.store.repo.delete_run` /
:func:`app.store.repo.delete_export`), then the files, only those under the data dir.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine

from app.settings import Settings
from app.store import repo
from app.store.schema import Run
from app.studio import access, audit
from app.studio.datasets import is_under
from app.studio.errors import StudioError
from app.studio.exports import export_job

if TYPE_CHECKING:
    from app.store.schema import Job, User


def _remove(path: str | Path | None, root: Path) -> None:
    """Delete a file or folder if it lies under ``root`` (never outside the data dir)."""
    if not path or not is_under(path, root):
        return
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _export_folder(settings: Settings, job: Job) -> Path:
    """Where the worker writes an export's files (``worker.jobs.export``)."""
    key = str((job.payload or {}).get("export_id") or f"export-{job.id}")
    return settings.data_dir / "exports" / key


def delete_run(engine: Engine, settings: Settings, actor: User, run_id: str) -> Run:
    """Delete a run, its exports and their files (the run folder: checkpoints, adapter,
    config.json; each export's folder). Its datasets and model stay (and may then be deleted).

    Raises:
        StudioError: not_found (unknown or another user's run); conflict (code ``run_in_use``)
            while one of its jobs is queued or running (training, an export being built, ...).
    """
    run = access.run(engine, actor, run_id)
    try:
        run, arts, exports = repo.delete_run(engine, run.id)
    except repo.InUse as exc:
        raise StudioError("conflict", in_use_words(run, exc.busy), None,
                          "run_in_use") from None
    except repo.NotFound:
        raise StudioError("not_found", f"no fine-tuning job with id {run_id!r}") from None
    _remove(run.output_dir or settings.data_dir / "runs" / run.id, settings.data_dir / "runs")
    for job in exports:
        _remove(_export_folder(settings, job), settings.data_dir / "exports")
    for a in arts:
        _remove(a.path, settings.data_dir)
    audit.record(engine, actor.id, "run.deleted", "run", run.id, name=run.name,
                 exports=[j.id for j in exports])
    return run


#: How the refusal names one busy job of a kind (``{id}``), and several (``{n}``, ``{ids}``).
_BUSY_WORDS = {"train": ("its training job is {state}", None),
               "grpo": ("its training job is {state}", None),
               "export": ("export {id} is {state}", "{n} exports in progress ({ids})"),
               "evaluate": ("evaluation {id} is {state}", "{n} evaluations in progress ({ids})"),
               "playground": ("a playground session is {state}",
                              "{n} playground sessions are queued or running")}


def in_use_words(run: Run, busy: list[tuple[int, str, str]]) -> str:
    """Why ``run`` cannot be deleted now, naming it by its name (its id when it has none) and
    every job of it still queued or running (``busy``: ``(id, kind, state)`` each): ``run
    alice-grpo2 is in use: 2 exports in progress (15 queued, 16 running); cancel them or wait
    until they end, then delete the run``. A playground session is stopped on the Playground
    page (its job id is nothing a user saw)."""
    parts, kinds = [], list(dict.fromkeys(kind for _, kind, _ in busy))
    for kind in kinds:
        mine = [(i, state) for i, k, state in busy if k == kind]
        one, many = _BUSY_WORDS.get(kind, (f"its {kind} job {{id}} is {{state}}",
                                           f"{{n}} {kind} jobs in progress ({{ids}})"))
        if len(mine) == 1 or many is None:
            parts.append(one.format(id=mine[0][0], state=mine[0][1]))
        else:
            parts.append(many.format(n=len(mine), ids=", ".join(f"{i} {st}" for i, st in mine)))
    several = len(busy) > 1
    if "playground" in kinds:
        remedy = ("stop it on the Playground page (or let it end when idle)" if not several
                  else "stop the playground session on the Playground page (or let it end when "
                  "idle), cancel the rest or wait until they end")
    else:
        remedy = "cancel them or wait until they end" if several else \
            "cancel it or wait until it ends"
    return f"run {run.name or run.id} is in use: {', '.join(parts)}; {remedy}, then delete the run"


def delete_export(engine: Engine, settings: Settings, actor: User, export_id: int) -> Job:
    """Delete an export and its files.

    Raises:
        StudioError: not_found (unknown, or of another user's run); conflict (code
            ``export_in_use``) while it is being built (queued or running), or while a
            queued or running playground session serves its GGUF (stop the session first).
    """
    job = export_job(engine, actor, export_id)
    from app.studio.playground import sessions_using

    arts = [a.id for a in repo.list_artifacts(engine, job.run_id) if a.job_id == job.id]
    users = sessions_using(engine, arts)
    if users:
        ids = ", ".join(str(j.id) for j in users)
        raise StudioError("conflict", f"export {job.id} is served by playground session "
                          f"{ids} (queued or running); stop it (POST /api/playground/sessions/"
                          "<id>/stop) or let it end when idle, then delete the export", None,
                          "export_in_use")
    try:
        job, arts = repo.delete_export(engine, job.id)
    except repo.InUse as exc:
        raise StudioError("conflict", str(exc), None, "export_in_use") from None
    except repo.NotFound:
        raise StudioError("not_found", f"no export with id {export_id}", "id") from None
    _remove(_export_folder(settings, job), settings.data_dir / "exports")
    for a in arts:
        _remove(a.path, settings.data_dir)
    audit.record(engine, actor.id, "export.deleted", "export", job.id, run=job.run_id,
                 format=(job.payload or {}).get("format"))
    return job
