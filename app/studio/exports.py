"""Exports of a finished run (adapter, merged 16-bit, GGUF, Ollama): queueing one, reading its
state, verification and files, and zipping its files for download.

An export is a queue job of kind ``export`` attached to its run; it belongs to the run's owner.
"""
from __future__ import annotations

import re
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from app.settings import Settings
from app.store import events, queue, repo
from app.store.schema import Job, JobState, Run
from app.store.specs import GGUF_TYPES, ExportSpec
from app.studio import access, audit, jobs
from app.studio.artifacts import checkpoint_step, is_server_path, without_server_paths
from app.studio.datasets import is_under
from app.studio.errors import StudioError, invalid, whole
from app.studio.job_states import no_checkpoint_words
from app.studio.runs import SpecError, field_errors

if TYPE_CHECKING:
    from app.store.schema import User

FORMATS = [("adapter", "LoRA adapter (PEFT)"), ("merged_16bit", "Merged 16-bit (safetensors)"),
           ("gguf", "GGUF"), ("ollama", "Ollama (GGUF + Modelfile)")]
#: The GGUF types an export may ask for: the form offers exactly what the API accepts.
QUANTS = list(GGUF_TYPES)
#: What a few GGUF types are for: the form's checkbox labels and the "needs a quantization"
#: message read these (Q2_K and TQ1_0 are smaller than Q4_K_M; TQ1_0 is the smallest).
QUANT_NOTES = {"F16": "16-bit weights", "Q8_0": "near-lossless, half the size of F16",
               "Q4_K_M": "common size/quality balance", "Q2_K": "small, lossy",
               "TQ1_0": "smallest; for ternary models"}
#: The export formats as a sentence names them, with their article.
FORMAT_WORDS = {"gguf": "a GGUF export", "ollama": "an Ollama export"}
#: The largest id a job row can have (a 64-bit signed integer); larger ids name nothing.
MAX_ID = 2**63 - 1


def export_job(engine: Engine, actor: User, export_id: int) -> Job:
    """The export job ``export_id`` if ``actor`` may see its run. Raises StudioError not_found."""
    if not 0 < export_id <= MAX_ID:
        raise StudioError("not_found", f"no export with id {export_id}", "id")
    try:
        return access.job(engine, actor, export_id, kind="export")
    except StudioError:
        raise StudioError("not_found", f"no export with id {export_id}", "id") from None


def cancel_export(engine: Engine, actor: User, export_id: int) -> Job:
    """Cancel export ``export_id`` while it is queued or being built (its run's owner or an
    admin); the worker stops it and removes its folder (:func:`app.studio.jobs.cancel`).
    Raises StudioError: not_found (unknown, or another user's); conflict when it already
    ended."""
    return jobs.cancel(engine, actor, export_job(engine, actor, export_id),
                       f"export {export_id}", "export")


def _export_key(job: Job) -> str:
    """The export's folder name under ``exports/`` (its artifacts' ``meta["export_id"]``)."""
    return ((job.result or {}).get("export_id") or (job.payload or {}).get("export_id")
            or f"export-{job.id}")


def _export_artifacts(engine: Engine, job: Job) -> list:
    """The artifact rows of export ``job`` (its files), not those of the run's other exports,
    which may carry the same file names."""
    key, kind = _export_key(job), (job.payload or {}).get("format")
    return [a for a in repo.list_artifacts(engine, job.run_id, kind=kind)
            if (a.meta or {}).get("export_id") == key]


def export_info(engine: Engine, job: Job) -> dict[str, Any]:
    """One export as the API and the run page show it: ``id``, ``run_id``, ``format``,
    ``quantization``, ``dtype`` (a merged export's written dtype once done, else the requested
    one or None), ``status``, ``error``, ``progress``, ``verification`` (the
    figures, or the diff of a failed check; a path in it is relative to the export's folder,
    never a server path), ``files`` (``name``, ``size``, ``sha256``, ``url``),
    ``ollama``, ``provenance`` (base model, revision, adapter, base weights merged into),
    ``cancel_requested`` and timestamps (epoch seconds)."""
    payload, result = job.payload or {}, job.result or {}
    export_key = _export_key(job)
    files = [{"name": a.name, "size": a.bytes, "sha256": a.sha256,
              "url": f"/artifacts/{a.id}/download"} for a in _export_artifacts(engine, job)]
    verification = result.get("verification")
    if verification is None and job.state == JobState.FAILED:
        for ev in reversed(events.since(engine, job.id, 0, 5000, types=["log"])):
            if "verification" in ev.data:
                verification = ev.data["verification"]
                break
    prog = events.latest(engine, job.id, "progress")
    return {"id": job.id, "object": "export", "run_id": job.run_id,
            "format": payload.get("format"), "quantization": payload.get("quantization", []),
            "dtype": (result.get("merged") or {}).get("dtype") or payload.get("dtype"),
            "checkpoint_step": payload.get("checkpoint_step"),
            "status": job.state, "error": job.error,
            "cancel_requested": bool(job.cancel_requested),
            "created_at": job.created_at, "finished_at": job.finished_at,
            "progress": prog.data if prog else None,
            "verification": without_server_paths(verification, export_key),
            "files": files, "ollama": public_ollama(result.get("ollama"), files),
            "provenance": public_provenance(result.get("provenance")),
            "events_url": f"/api/exports/{job.id}/events"}


def public_provenance(prov: dict[str, Any] | None) -> dict[str, Any] | None:
    """``prov`` (:func:`worker.export.provenance.provenance`'s record) as members see it: a
    ``base_model`` that is a server path (older records of local or llama2.c bases held the
    checkpoint's path) becomes the model's name, as newer records write it."""
    if not prov or not is_server_path(prov.get("base_model")):
        return prov
    name = prov.get("base_model_name") or Path(prov["base_model"].split("|")[0]).stem
    return {**prov, "base_model": name}


#: An older Ollama command began by changing into the export's server folder.
_CD_PREFIX = re.compile(r"^cd (?:'[^']*'|\S+) && ")


def public_ollama(ollama: dict[str, Any] | None, files: list[dict[str, Any]]
                  ) -> dict[str, Any] | None:
    """An Ollama export's record as members see it: ``modelfile`` and ``gguf`` as file names
    (older records held server paths) with their download URLs (``modelfile_url``,
    ``gguf_url``, None when the file is not among ``files``), and ``command`` run in the
    folder the files are downloaded to (``ollama create NAME -f Modelfile``)."""
    if not ollama:
        return ollama
    urls = {f["name"]: f["url"] for f in files}
    out = dict(ollama)
    for key in ("modelfile", "gguf"):
        if isinstance(out.get(key), str):
            out[key] = Path(out[key]).name
            out[f"{key}_url"] = urls.get(out[key])
    if isinstance(out.get("command"), str):
        out["command"] = _CD_PREFIX.sub("", out["command"])
    return out


def list_exports(engine: Engine, actor: User, run_id: str) -> list[dict[str, Any]]:
    """The exports of a run ``actor`` may see, newest first (:func:`export_info` each).
    Raises StudioError not_found."""
    access.run(engine, actor, run_id)
    return [export_info(engine, j) for j in repo.list_run_jobs(engine, run_id, "export")]


def checkpoint_steps(engine: Engine, run_id: str) -> list[int]:
    """The steps of the run's trainer checkpoints still on disk (``Artifact(kind="checkpoint")``
    rows the worker records as it saves them, whose folder holds an adapter), newest first."""
    steps = {checkpoint_step(a) for a in repo.list_artifacts(engine, run_id, "checkpoint")}
    return sorted((s for s in steps if s is not None), reverse=True)


def exportable(engine: Engine, run_id: str, job: Job | None) -> tuple[bool, int | None]:
    """(whether the run can be exported now, the checkpoint step an export uses by default): a
    succeeded run exports its final adapter (None); a cancelled or failed one its newest
    checkpoint, when it saved one."""
    if job is not None and job.state == JobState.SUCCEEDED:
        return True, None
    if job is not None and job.state in (JobState.CANCELLED, JobState.FAILED):
        steps = checkpoint_steps(engine, run_id)
        return bool(steps), (steps[0] if steps else None)
    return False, None


def _checkpoint_step(engine: Engine, run: Run, job: Job | None, asked) -> int | None:
    """The checkpoint an export request uses (see :func:`queue_export`). Raises StudioError."""
    run_id = run.id
    state = job.state if job else "unknown"
    if job is None or job.state in (JobState.QUEUED, JobState.RUNNING):
        raise StudioError("conflict", f"run {run_id} has not finished training (state: "
                                      f"{state}); export it once it has succeeded, or cancel "
                                      "it and export its newest checkpoint")
    steps = checkpoint_steps(engine, run_id)
    if asked not in (None, ""):
        step = whole(asked)  # 12.5, 1e999, True or "²" is no step (int() cut or raised)
        if step is None:
            raise invalid("checkpoint_step", "must be a whole number (a checkpoint's step)")
        if step not in steps:
            from app.studio.checkpoint_eval import missing_words
            raise invalid("checkpoint_step", missing_words(engine, run_id, step, steps))
        return step
    if job.state == JobState.SUCCEEDED:
        return None
    if not steps:
        raise StudioError("conflict", f"run {run_id} {no_checkpoint_words(run, job)}; there is "
                                      "nothing to export")
    return steps[0]


def _same_export(run_id: str, payload: dict[str, Any]):
    """The finder :func:`app.store.queue.enqueue_unless` runs: the run's queued or running
    export (not being cancelled) of exactly ``payload``, or None."""
    def find(s: Session) -> Job | None:
        live = s.exec(select(Job).where(
            Job.kind == "export", Job.run_id == run_id, Job.cancel_requested == False,  # noqa: E712
            Job.state.in_([JobState.QUEUED, JobState.RUNNING])).order_by(Job.id)).all()
        return next((j for j in live if j.payload == payload), None)
    return find


def queue_export(engine: Engine, actor: User, run_id: str,
                 body: dict[str, Any]) -> tuple[Job, bool]:
    """Validate an export request (``format``, ``quantization`` as a list or a comma/space
    separated string, ``dtype``, ``checkpoint_step``) and queue its job. A succeeded run exports
    its final adapter; a cancelled or failed one the newest checkpoint the trainer saved (or
    the ``checkpoint_step`` asked for, which a succeeded run may name too).

    Returns ``(job, reused)``: an export of the same run with the same settings already queued
    or running is that job, not a second one (a double click, a client's retry; trial s24), the
    look and the insert one write transaction.

    Raises:
        StudioError: not_found (unknown or another user's run), conflict (still training, or
            ended before any checkpoint), invalid (unknown field, bad
            format/quantization/dtype, a gguf or ollama export without a quantization, a
            checkpoint step the run does not have).
    """
    run, job = access.run_with_job(engine, actor, run_id)
    step = _checkpoint_step(engine, run, job, body.get("checkpoint_step"))
    unknown = sorted(str(k) for k in set(body) - {"format", "quantization", "dtype",
                                                   "checkpoint_step"})
    if unknown:
        raise invalid(unknown[0], f"unknown field {unknown[0]!r}; an export takes format, "
                                  "quantization, dtype and checkpoint_step")
    quant = body.get("quantization") or []
    if isinstance(quant, str):
        quant = [q.strip() for q in quant.replace(",", " ").split() if q.strip()]
    try:
        spec = ExportSpec(run_id=run.id, format=body.get("format"),
                          quantization=quant, dtype=body.get("dtype") or None,
                          checkpoint_step=step)
    except ValidationError as exc:
        raise SpecError(*field_errors(exc)) from None
    if spec.quantization and spec.format not in ("gguf", "ollama"):
        raise invalid("quantization", f"applies to gguf and ollama exports, not {spec.format}")
    if not spec.quantization and spec.format in ("gguf", "ollama"):
        examples = ", ".join(f"{q} ({QUANT_NOTES[q]})" for q in ("Q8_0", "F16", "Q4_K_M"))
        raise invalid("quantization", f"{FORMAT_WORDS[spec.format]} needs at least one GGUF "
                                      f"type, e.g. {examples}")
    payload = spec.model_dump(mode="json")
    if spec.format == "ollama":
        payload["model_name"] = ollama_model_name(run)
    job, reused = queue.enqueue_unless(engine, "export", payload, _same_export(run.id, payload),
                                       run_id=run.id, priority=5, max_attempts=2,
                                       owner=run.owner)
    if not reused:
        audit.record(engine, actor.id, "export.created", "export", job.id, run=run.id,
                     format=spec.format, quantization=spec.quantization,
                     **({"checkpoint_step": step} if step else {}))
    return job, reused


def slug(text: str, limit: int = 60, keep: str = "", unicode: bool = False) -> str:
    """A file-name-safe slug of a run name: lower-case ASCII letters, digits, ``-`` and the
    characters of ``keep`` (``"My run: v2 (final)"`` → ``my-run-v2-final``), starting and
    ending with a letter or digit, at most ``limit`` characters; empty when nothing is left.
    ``unicode``: letters and digits of any script stay (NFC; ``"Ünïcødé 名前"`` →
    ``ünïcødé-名前``), for a download's name (sent as RFC 6266 ``filename*``); without it
    accents are dropped and other scripts removed (Ollama model names, paths on disk)."""
    import unicodedata

    ends = "-" + keep
    if unicode:
        text = unicodedata.normalize("NFC", text).lower()
    else:
        text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    out = re.sub("-+", "-", "".join(c if c.isalnum() or c in keep else "-" for c in text))
    return out.strip(ends)[:limit].strip(ends)


#: Characters of an Ollama model name besides letters, digits and ``-`` (Ollama allows at most
#: 80 characters, the first a letter, digit or ``_``).
OLLAMA_KEEP = "._"
#: The longest default Ollama model name (Ollama's limit is 80).
OLLAMA_NAME_MAX = 64


def ollama_model_name(run: Run) -> str:
    """The model an Ollama export of ``run`` creates (``ollama create NAME``), the one rule for
    every surface: the run's name as Ollama allows it (:func:`slug` keeping ``.`` and ``_``),
    then the last 8 characters of the run id, so that two runs of one name never replace each
    other's model (``"My run: v2.1"`` → ``my-run-v2.1-3f9a0c1b``); at most
    :data:`OLLAMA_NAME_MAX` characters. A run without a name, or whose name has no letter or
    digit Ollama allows: the run id (``ftjob-3f9a0c1b2d4e5f60``). An export already queued
    keeps the name in its payload."""
    tail = run.id[-8:].lower()
    base = slug(run.name or "", OLLAMA_NAME_MAX - len(tail) - 1, OLLAMA_KEEP)
    if not base:
        return slug(run.id, OLLAMA_NAME_MAX, OLLAMA_KEEP) or tail
    return f"{base}-{tail}"


def download_name(engine: Engine, run_id: str | None, filename: str) -> str:
    """The name a run's file downloads under: a run with a name is named by the slug of it,
    in any script (``ftjob-…-Q8_0.gguf`` → ``my-run-Q8_0.gguf``, ``adapter.zip`` →
    ``my-run-adapter.zip``, ``名前-adapter.zip``); otherwise ``filename`` unchanged."""
    try:
        run = repo.get_run(engine, run_id) if run_id else None
    except repo.NotFound:
        run = None
    name = slug(run.name, unicode=True) if run is not None and run.name else ""
    if not name:
        return filename
    return filename.replace(run.id, name) if run.id in filename else f"{name}-{filename}"


def zip_export(engine: Engine, settings: Settings, actor: User, export_id: int) -> tuple[Path, str]:
    """Zip an ended export's files into a temporary file: ``(zip path, download name)``; the
    caller deletes the file once sent. A failed GGUF export offers the types that passed.

    Raises:
        StudioError: not_found; conflict when the export is still running or has no files.
    """
    job = export_job(engine, actor, export_id)
    info = export_info(engine, job)
    if info["status"] in (JobState.QUEUED, JobState.RUNNING) or not info["files"]:
        why = "is still running" if info["status"] in (JobState.QUEUED, JobState.RUNNING) else \
            f"{info['status']} and kept no file"
        raise StudioError("conflict", f"export {export_id} has no files: it {why}")
    arts = {a.name: a for a in _export_artifacts(engine, job)}
    tmp = tempfile.NamedTemporaryFile(prefix="whetstone-export-", suffix=".zip", delete=False)
    tmp.close()
    with zipfile.ZipFile(tmp.name, "w", zipfile.ZIP_STORED) as z:
        for f in info["files"]:
            path = Path(arts[f["name"]].path)
            if is_under(path, settings.data_dir) and path.is_file():
                z.write(path, arcname=download_name(engine, info["run_id"], f["name"]))
    audit.record(engine, actor.id, "export.downloaded", "export", export_id, run=info["run_id"])
    return Path(tmp.name), download_name(engine, info["run_id"],
                                         f"{info['run_id']}-{info['format']}-{export_id}.zip")
