"""Datasets: recording an upload (SFT or GRPO prompts), its validation report, listing, deleting.

The web receives the bytes (``app.web.uploads``, streamed to a temporary file); from there on
everything is here: the file type, the report computed with the tokenizer and chat template a
run would use (the same resolver as run creation, so preview == training), the owner.
"""
from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.data.chat_template import choose_template
from app.data.errors import DatasetError
from app.data.model_config import context_length
from app.settings import Settings
from app.store import queue, repo
from app.store.schema import Dataset, Model, Run, new_id
from app.store.specs import TrainSpec
from app.studio import access, audit, validation
from app.studio.errors import StudioError, invalid
from app.studio.reports import fallback_tokenizer_dir, inspect_file

if TYPE_CHECKING:
    from app.store.schema import User

SUPPORTED = (".json", ".jsonl", ".ndjson", ".csv", ".tsv", ".parquet", ".txt")


def safe_filename(name: str, limit: int = 120) -> str:
    """A file-system-safe version of an uploaded file's name that keeps its extension: path
    parts dropped, unusual characters replaced by ``_``, the stem shortened so the whole name
    fits ``limit`` bytes of UTF-8 (file systems count bytes: 255 at most a name, and one
    character of a non-Latin name takes 2-4)."""
    base = os.path.basename(name.replace("\\", "/")) or "upload"
    stem, ext = os.path.splitext(base)
    clean = "".join(c if c.isalnum() or c in "._-" else "_" for c in stem).strip("._") or "upload"
    ext = "".join(c for c in ext if c.isascii() and (c.isalnum() or c == "."))[:16]
    room = max(1, limit - len(ext))
    clean = clean.encode("utf-8")[:room].decode("utf-8", "ignore") or "upload"
    return clean + ext


def display_name(name: str, limit: int = 255) -> str:
    """The name an uploaded file is shown and recorded under (``Dataset.filename``): the client's
    name as sent, less what a name must not carry: the path before its last ``/`` or ``\\``,
    control and format characters (newlines, NUL, right-to-left overrides), surrounding blanks
    and leading dots (no hidden-file names); at most ``limit`` characters, a longer one cut in
    the stem with ``…`` so its extension stays. ``"upload"`` when nothing is left, and a name
    that is only an extension (``.jsonl``) keeps it as ``upload.jsonl``: a user who names a
    file ``.jsonl`` means a JSONL file. Pages escape it when they show it; the file on disk is
    named by :func:`safe_filename`. An ordinary name (``identity_alpaca.json``, ``my
    data.csv``, ``données.jsonl``) comes back unchanged."""
    base = str(name).replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if unicodedata.category(c)[0] != "C").strip()
    rest = base.lstrip(". ").strip()
    if rest and rest != base and "." not in rest:
        rest = f"upload.{rest}"  # only an extension: its stem was the leading dot
    base = rest or "upload"
    if len(base) > limit:
        stem, ext = os.path.splitext(base)
        ext = ext if len(ext) <= 16 else ""
        base = stem[:max(1, limit - len(ext) - 1)].rstrip() + "…" + ext
    return base


def ready_tokenizer_path(model: Model | None) -> str | None:
    """The local folder of a ready model (its tokenizer lives there), else None."""
    if model is not None and model.status == "ready" and model.path and os.path.isdir(model.path):
        return model.path
    return None


def tokenizer_for(model: Model | None, settings: Settings) -> tuple[str | None, str | None]:
    """(tokenizer folder, label) for a report: the model's, else the seed dir's GPT-2 BPE."""
    path = ready_tokenizer_path(model)
    if path:
        return path, model.name
    fallback = fallback_tokenizer_dir(settings.seed_dir)
    if fallback:
        return fallback, "gpt2-bpe (until a model is ready)"
    return None, None


def list_datasets(engine: Engine, actor: User, limit: int = 200) -> list[Dataset]:
    """The datasets ``actor`` may see, newest first."""
    return repo.list_datasets(engine, limit=limit, owner=access.owner_filter(actor))


def pickable_datasets(engine: Engine, actor: User) -> list[Dataset]:
    """The datasets a run form offers ``actor``: their own first (newest first), then, for an
    admin, other users' (newest first). The form's default is the first, so an admin's run does
    not pick up (and then hold) another user's upload unnoticed."""
    return sorted(list_datasets(engine, actor), key=lambda d: d.owner != actor.id)


def in_use_message(engine: Engine, actor: User, ds: Dataset) -> str:
    """Why ``ds`` cannot be deleted now, in the names a user knows: its file name and what is
    reading it, each run by name with the job and its state ("identity_alpaca.json is used by
    run alice-first, whose training job is queued", "... by alice-first (training job running)
    and bob-run (checkpoint evaluation queued)") and when to try again; a run ``actor`` may not
    see (another user's) is counted, never named (its id would answer 404 anyway). Runs that
    ended, and their exports and playground sessions, do not hold a dataset
    (:func:`delete_dataset`)."""
    runs: dict[str, tuple[Run, str, str]] = {}  # run id -> (run, its job in words, state)
    for run, _, kind, state in repo.active_uses(engine, ds.id):
        runs.setdefault(run.id, (run, _JOB_WORDS.get(kind, kind + " job"), state))
    if not runs:  # they ended since the refusal
        return f"{ds.filename} was in use by a run that has ended since: delete it again"
    listed = list(runs.values())
    seen = [(r, job, state) for r, job, state in listed if access.can_see(actor, r.owner)]
    hidden = len(listed) - len(seen)
    role = "used by" if any(r.dataset_id == ds.id for r, _, _ in listed) else \
        "the validation_file of"
    if len(listed) == 1:
        run_words = f"run {seen[0][0].name or seen[0][0].id}" if seen else "another user's run"
        _, job, state = listed[0]
        return (f"{ds.filename} is {role} {run_words}, whose {job} is {state}: delete it once "
                "that has ended (or cancel it)")
    named = [f"{r.name or r.id} ({job} {state})" for r, job, state in seen]
    if hidden:
        named.append(f"{hidden} run{'s' if hidden > 1 else ''} of other users")
    who = ", ".join(named[:-1]) + " and " + named[-1]
    return f"{ds.filename} is {role} {who}: delete it once those have ended (or cancel them)"


#: A job kind that reads a dataset, as the refusal names it.
_JOB_WORDS = {"train": "training job", "grpo": "training job",
              "evaluate": "checkpoint evaluation"}

def usable_models(engine: Engine, actor: User) -> list[Model]:
    """The models ``actor`` may train on or preview with: :func:`app.studio.models.usable_models`
    (own and shared, all for an admin; not a failed import)."""
    from app.studio import models  # models imports this module

    return models.usable_models(engine, actor)


def default_model(engine: Engine, actor: User) -> Model | None:
    """The model used for a dataset's first report: the first ready one ``actor`` may use."""
    models = usable_models(engine, actor)
    return next((m for m in models if m.status == "ready"), models[0] if models else None)


def context_window(model: Model | None) -> int | None:
    """The model's context window in tokens: ``max_position_embeddings`` recorded at import (its
    ``info``; stories260K has 512), else from the ``config.json`` of its folder
    (:func:`app.data.model_config.context_length`); None when neither says or there is no model.
    The one rule every length check reads: the SFT ``max_seq_length`` and its default, a GRPO
    prompt + completion (:mod:`app.studio.seqlen`), a Playground session's estimate."""
    if model is None:
        return None
    n = (model.info or {}).get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else context_length(model.path)


def default_max_seq_length(model: Model | None) -> int:
    """The max_seq_length a run form and a dataset's report start from, in tokens: TrainSpec's
    default capped at the model's :func:`context_window`, so the report counts over-long rows
    against the length the run will use."""
    default = TrainSpec.model_fields["max_seq_length"].default
    limit = context_window(model)
    return min(default, limit) if limit else default


def report_for(path: str, model: Model | None, template_choice: str | None, max_seq_length: int,
               settings: Settings, dataset_format: str | None = None,
               on_rows=None, column_mapping: dict[str, str] | None = None) -> dict[str, Any]:
    """The validation report of the file at ``path`` as a run on ``model`` would see it, with the
    chat template chosen exactly as run creation chooses it. Blocking (tokenises the file);
    ``on_rows(n)`` is called as rows are read and may raise to stop. ``column_mapping``: the
    dataset's own (:func:`column_mapping`), which training applies too.

    Raises:
        DatasetError: the file cannot be used (the message names the row and field).
    """
    name, text = choose_template(template_choice, model.chat_template if model else None)
    tok_dir, label = tokenizer_for(model, settings)
    report = inspect_file(path, tokenizer_dir=tok_dir, chat_template=text,
                          max_seq_length=max_seq_length, dataset_format=dataset_format,
                          on_rows=on_rows, column_mapping=column_mapping)
    report.update(model=model.name if model else None, model_id=model.id if model else None,
                  tokenizer=label, template_name=name)
    return report


def _prompts_report(path: Path, sft_error: DatasetError, prompt_column: str | None = None,
                    answer_column: str | None = None) -> dict | None:
    """The prompt-dataset report of a file that is no SFT dataset (GSM8K rows, OpenAI RFT rows
    whose messages end on a user turn), with the SFT reason kept; None when it is neither.

    Raises:
        DatasetError: a file with malformed messages (an unknown role, an empty assistant
            turn) is neither: the SFT reason plus each bad row, by number, with its reason.
    """
    from app.data.prompts import inspect_prompts

    try:
        report = inspect_prompts(str(path), prompt_column, answer_column)
    except DatasetError:
        return None
    if report["invalid"]:
        rows = "; ".join(f"row {i['row']}, field {i['field']!r}: {i['message']}"
                         for i in report["invalid"][:10])
        more = len(report["invalid"]) - 10
        raise DatasetError(f"{sft_error}; it is no GRPO prompt dataset either: {rows}"
                           f"{f'; and {more} more' if more > 0 else ''}")
    return {**report, "format": "prompts", "sft_error": str(sft_error)}


def _place(settings: Settings, temp_path: Path, filename: str) -> tuple[str, Path, str]:
    """Check the extension and move the received file to its final name under uploads/
    (``<dataset id>-<safe_filename>``: unique, a base name only, length-capped); returns
    ``(dataset id, final path, display name)`` (:func:`display_name` of ``filename``).
    Raises StudioError(invalid, ``file``); the temporary file is removed then."""
    filename = display_name(filename)
    ext = os.path.splitext(filename)[1].lower()
    if ext not in SUPPORTED:
        Path(temp_path).unlink(missing_ok=True)
        raise invalid("file", f"unsupported file type {ext or '(no extension)'!r}; "
                              f"use one of {', '.join(SUPPORTED)}")
    ds_id = new_id("file")
    final = settings.data_dir / "uploads" / f"{ds_id}-{safe_filename(filename)}"
    os.replace(temp_path, final)
    return ds_id, final, filename


@contextmanager
def _removed_on_error(path: Path) -> Iterator[None]:
    """Delete ``path`` when the block raises (nothing half-recorded stays on disk)."""
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def record_upload(engine: Engine, settings: Settings, actor: User, temp_path: Path, filename: str,
                  size: int, *, prompts_fallback: bool = False) -> Dataset:
    """Record a received file as an SFT dataset owned by ``actor``, in state ``validating``,
    and queue its validation (a ``validate_dataset`` job, :mod:`app.studio.validation`);
    returns at once. The temporary file is consumed: moved under ``uploads/`` or deleted.

    ``prompts_fallback`` (the OpenAI Files API, where SFT and reinforcement files share
    ``purpose="fine-tune"``): a file that is no SFT dataset but a GRPO prompt dataset is recorded
    as one (format ``prompts``; an SFT job on it is refused with the reason).

    Raises:
        StudioError: invalid (field ``file``) for an unsupported file type.
    """
    ds_id, final, filename = _place(settings, temp_path, filename)
    with _removed_on_error(final):
        return validation.start(engine, actor, ds_id, final, filename, size, "fine-tune",
                                {"mode": "sft_or_prompts" if prompts_fallback else "sft"})


def uploaded_for_grpo(ds: Dataset) -> bool:
    """True for a GRPO prompt dataset (format ``prompts``) and for a file uploaded as one
    (purpose ``grpo``) whose validation failed: its page is the prompt dataset's, never the
    SFT report with SFT training controls."""
    return ds.format == "prompts" or ds.purpose == "grpo"


def record_prompt_upload(engine: Engine, settings: Settings, actor: User, temp_path: Path,
                         filename: str, size: int, prompt_column: str | None = None,
                         answer_column: str | None = None) -> Dataset:
    """Record a received file as a GRPO prompt dataset owned by ``actor``, in state
    ``validating``, and queue its validation; returns at once (the file is consumed).

    Raises:
        StudioError: invalid (field ``file``) for an unsupported file type.
    """
    ds_id, final, filename = _place(settings, temp_path, filename)
    with _removed_on_error(final):
        return validation.start(engine, actor, ds_id, final, filename, size, "grpo",
                                {"mode": "prompts", "prompt_column": prompt_column or None,
                                 "answer_column": answer_column or None})


def compute_report(engine: Engine, settings: Settings, ds: Dataset, options: dict[str, Any],
                   on_rows=None) -> tuple[dict[str, Any], str]:
    """(report, purpose) of an uploaded file for ``options["mode"]`` (see
    :func:`record_upload`): the SFT report with the owner's default model, or the prompt report.
    ``on_rows(n)`` is called as rows are read (it may raise to stop). Blocking.

    Raises:
        DatasetError: the file is no usable dataset (the message names the row and field).
    """
    from app.data.prompts import inspect_prompts

    if options.get("mode") == "prompts":
        report = inspect_prompts(ds.path, options.get("prompt_column"),
                                 options.get("answer_column"), on_rows=on_rows)
        return {**report, "format": "prompts"}, "grpo"
    from app.studio.accounts import get_user

    try:
        owner = get_user(engine, ds.owner) if ds.owner else None
    except StudioError:  # the uploader's account is gone: the report still needs a tokenizer
        owner = None
    model = default_model(engine, owner) if owner else None
    try:
        return report_for(ds.path, model, None, default_max_seq_length(model), settings,
                          on_rows=on_rows, column_mapping=options.get("column_mapping")), \
            ds.purpose
    except DatasetError as exc:
        report = _prompts_report(Path(ds.path), exc) if options.get("mode") == "sft_or_prompts" \
            else None
        if report is None:
            raise
        return report, ds.purpose


def stored_report(ds: Dataset) -> dict[str, Any] | None:
    """The report a processed dataset's page shows (None for one validating or in error),
    normalized as a new one is (:func:`app.studio.reports.normalize_report`), so a report
    stored before a key existed (a preview row's ``truncation_note``) shows it too."""
    from app.studio.reports import normalize_report

    if ds.status != validation.PROCESSED or not ds.report:
        return None
    return normalize_report(ds.report, ds.report.get("max_seq_length"))


def delete_dataset(engine: Engine, settings: Settings, actor: User, dataset_id: str) -> Dataset:
    """Delete a dataset and its uploaded file. Runs that ended keep their record of it: a
    dataset they trained or evaluated on keeps its row, marked deleted (their pages name it
    "identity.json (deleted)"; they can no longer resume or rebuild their held-out set, and
    a clone asks for another dataset: :func:`deleted_input`).

    Raises:
        StudioError: not_found (unknown, deleted, or another user's); conflict (code
            ``file_in_use``) while a queued or running job of a run uses it.
    """
    ds = access.dataset(engine, actor, dataset_id)
    if ds.status == validation.VALIDATING and validation.job_id(ds) is not None:
        queue.cancel(engine, validation.job_id(ds))  # its job stops at the next batch of rows
    try:
        _, kept = repo.delete_dataset(engine, ds.id)
    except repo.InUse:
        raise StudioError("conflict", in_use_message(engine, actor, ds), "file_id",
                          "file_in_use") from None
    except repo.NotFound:  # another request deleted it first
        raise StudioError("not_found", f"no dataset with id {dataset_id}", "file_id") from None
    if is_under(ds.path, settings.data_dir / "uploads"):
        Path(ds.path).unlink(missing_ok=True)
    audit.record(engine, actor.id, "dataset.deleted", "dataset", ds.id, filename=ds.filename,
                 kept_for_runs=kept)
    return ds


def shown_name(ds: Dataset) -> str:
    """A dataset's file name as a run's pages name it: ``identity.json``, or
    ``identity.json (deleted)`` once deleted (its row kept as the runs' record)."""
    return ds.filename + (" (deleted)" if ds.status == repo.DELETED else "")


def deleted_name(engine: Engine, dataset_id: str) -> str | None:
    """The file name of dataset ``dataset_id`` when it was deleted (its id when even its row is
    gone), None while it exists."""
    try:
        repo.get_dataset(engine, dataset_id)
        return None
    except repo.NotFound:
        pass
    try:
        return repo.get_dataset(engine, dataset_id, deleted=True).filename
    except repo.NotFound:
        return dataset_id


def deleted_input(engine: Engine, run: Run) -> str | None:
    """What ``run`` did with an input of it that was deleted, by the file's name ("trains on
    dataset identity.json", "evaluates on validation_file alpaca.json"), or None when neither
    its training dataset nor its ``validation_file`` was deleted."""
    wanted = [("trains on dataset", run.dataset_id),
              ("evaluates on validation_file", (run.spec or {}).get("validation_file"))]
    for what, ds_id in wanted:
        gone = deleted_name(engine, ds_id) if ds_id else None
        if gone is not None:
            return f"{what} {gone}"
    return None


def downloaded(engine: Engine, actor: User, object_type: str, object_id: str | int,
               **detail) -> None:
    """Record in the audit log that ``actor`` downloaded a file (a dataset, artifact or export)."""
    audit.record(engine, actor.id, f"{object_type}.downloaded", object_type, str(object_id),
                 **detail)


def is_under(path: str | Path, root: str | Path) -> bool:
    """True when ``path`` resolves inside ``root`` (no escaping through .. or links)."""
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except (ValueError, OSError):
        return False
