"""Operations shared by the browser pages, the native /api and the OpenAI-style /v1 API."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from app.data.errors import DatasetError
from app.settings import Settings
from app.store import repo
from app.store.schema import Dataset, Model, new_id
from app.store.specs import TrainSpec
from app.web.inspect import default_templates, fallback_tokenizer_dir, inspect_file
from app.web.uploads import UploadError, receive_upload, safe_filename

SUPPORTED = (".json", ".jsonl", ".ndjson", ".csv", ".tsv", ".parquet", ".txt")


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


def default_model(engine: Engine) -> Model | None:
    """The model used for a dataset's first report: the first ready one, if any."""
    models = repo.list_models(engine)
    for m in models:
        if m.status == "ready":
            return m
    return models[0] if models else None


def default_max_seq_length(model: Model | None) -> int:
    """The max_seq_length a run form and a dataset's report start from, in tokens: TrainSpec's
    default capped at the model's context length (``max_position_embeddings`` recorded at import;
    stories260K has 512), so the report counts over-long rows against the length the run will use."""
    default = TrainSpec.model_fields["max_seq_length"].default
    limit = ((model.info or {}) if model else {}).get("max_position_embeddings")
    return min(default, limit) if isinstance(limit, int) and limit > 0 else default


def resolve_template(model: Model | None, choice: str | None) -> tuple[str | None, str | None]:
    """(template name, Jinja text) to use: the model's own, else a built-in default."""
    if model is not None and model.chat_template and choice in (None, "", "model"):
        return "model", model.chat_template
    defaults = default_templates()
    if choice and choice in defaults:
        return choice, defaults[choice]
    if choice and "{" in choice:
        return "custom", choice
    name = next(iter(defaults))
    return name, defaults[name]


async def report_for(path: str, model: Model | None, template_choice: str | None,
                     max_seq_length: int, settings: Settings,
                     dataset_format: str | None = None) -> dict[str, Any]:
    """The validation report of ``path`` as seen by ``model`` (raises DatasetError)."""
    name, text = resolve_template(model, template_choice)
    tok_dir, label = tokenizer_for(model, settings)
    report = await run_in_threadpool(
        inspect_file, path, tokenizer_dir=tok_dir, chat_template=text,
        max_seq_length=max_seq_length, dataset_format=dataset_format)
    report["model"] = model.name if model else None
    report["model_id"] = model.id if model else None
    report["tokenizer"] = label
    report["template_name"] = name
    return report


async def _prompts_report(path: Path, sft_error: DatasetError) -> dict | None:
    """The prompt-dataset report of a file that is no SFT dataset (GSM8K rows, OpenAI RFT rows
    whose messages end on a user turn), with the SFT reason kept; None when it is neither."""
    from app.data.prompts import inspect_prompts

    try:
        report = await run_in_threadpool(inspect_prompts, str(path), None, None)
    except DatasetError:
        return None
    return {**report, "format": "prompts", "sft_error": str(sft_error)}


async def upload_dataset(request: Request, settings: Settings, engine: Engine,
                         purpose_required: bool = False, prompts_fallback: bool = False
                         ) -> tuple[Dataset, dict[str, str]]:
    """Receive a multipart upload, validate it with the dataset layer and record it.

    ``prompts_fallback`` (the OpenAI Files API, where SFT and reinforcement files share
    ``purpose="fine-tune"``): a file that is no SFT dataset but a GRPO prompt dataset is recorded
    as one (format ``prompts``; an SFT job on it is refused with the reason).

    Raises:
        UploadError: transport problems (size limit → 413, no file, empty file).
        DatasetError: the file's content is unusable (the file is deleted again).
    """
    up = await receive_upload(request, settings.data_dir / "uploads", settings.max_upload_mb)
    fields = up.fields
    try:
        if purpose_required and fields.get("purpose", "fine-tune") != "fine-tune":
            raise UploadError(f"purpose {fields.get('purpose')!r} is not supported; use 'fine-tune'",
                              400, "purpose")
        original = up.filename or "upload"
        ext = os.path.splitext(original)[1].lower()
        if ext not in SUPPORTED:
            raise DatasetError(f"unsupported file type {ext or '(no extension)'!r}; "
                               f"use one of {', '.join(SUPPORTED)}")
    except Exception:
        up.discard()
        raise
    ds_id = new_id("file")
    final = settings.data_dir / "uploads" / f"{ds_id}-{safe_filename(original)}"
    os.replace(up.temp_path, final)
    up.temp_path = None
    try:
        model = default_model(engine)
        report = await report_for(str(final), model, None, default_max_seq_length(model), settings)
    except DatasetError as exc:
        report = await _prompts_report(final, exc) if prompts_fallback else None
        if report is None:
            final.unlink(missing_ok=True)
            raise
    except Exception:
        final.unlink(missing_ok=True)
        raise
    ds = Dataset(id=ds_id, filename=original, path=str(final.resolve()), bytes=up.bytes,
                 format=report.get("format"), rows=report.get("valid_rows") or report.get("rows"),
                 purpose="fine-tune", status="processed", report=report)
    repo.add_dataset(engine, ds)
    return ds, fields


SAMPLE_CHATS = (
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "2 + 2 = 4."}],
    [{"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "2 + 2 = 4."}],
)


def chat_template_problem(requested: str | None, model_template: str | None) -> str | None:
    """Why the run's chat template cannot be used, else None.

    ``requested`` is a built-in name or Jinja source (else the model's own template is used).
    The template must parse and render a sample system+user+assistant conversation; a template
    that refuses a system turn is accepted when it renders the same chat without one, and the
    render must contain every user and assistant message's content. The message is the template's own (its
    ``raise_exception`` text, or the syntax error and line) or names the messages it drops.
    """
    from app.data.chat_template import render_chat, resolve_template

    try:
        source = resolve_template(requested, model_template)
    except DatasetError as exc:
        return str(exc)
    if not source:
        return None  # the worker falls back to a built-in default
    first = None
    for chat in SAMPLE_CHATS:
        try:
            text = render_chat(chat, source, bos_token="<s>", eos_token="</s>")
        except DatasetError as exc:
            first = first or str(exc)
            continue
        lost = [m["role"] for m in chat  # a template may fold or drop the system turn
                if m["role"] != "system" and m["content"] not in text]
        if lost:
            return (f"the template does not write the {' and '.join(lost)} messages (a sample "
                    f"chat renders as {text[:80]!r}); nothing would be trained")
        return None
    return first


def delete_model(engine: Engine, settings: Settings, model_id: str) -> Model:
    """Delete a registered model (by id or name) that no run uses, and its prepared folder
    under the data dir; return it.

    Raises:
        repo.NotFound: no such model.
        repo.InUse: a run uses it, or it is still being imported (message says which).
    """
    import shutil

    from sqlmodel import select

    from app.store.db import session_scope
    from app.store.schema import Run

    model = repo.get_model(engine, model_id)
    with session_scope(engine, immediate=True) as s:
        row = s.get(Model, model.id)
        if row is None:
            raise repo.NotFound(f"no model {model_id!r} is registered")
        if row.status == "pending":
            raise repo.InUse(f"model {row.name!r} is still being imported; delete it once it is "
                             "ready or failed")
        used = s.exec(select(Run.id).where(Run.model_id == row.id).limit(1)).first()
        if used is not None:
            raise repo.InUse(f"model {row.name!r} is used by run {used}; it cannot be deleted "
                             "while runs refer to it")
        s.delete(row)
    if model.path and is_under(model.path, settings.data_dir) and os.path.isdir(model.path):
        shutil.rmtree(model.path, ignore_errors=True)
    return model


def field_errors(exc: ValidationError) -> tuple[dict[str, str], list[str]]:
    """Map a pydantic ValidationError to ``{field: message}`` plus form-level messages."""
    out: dict[str, str] = {}
    general: list[str] = []
    for err in exc.errors():
        loc = err.get("loc") or ()
        msg = err.get("msg", "invalid value")
        msg = msg.removeprefix("Value error, ")
        if loc:
            out.setdefault(str(loc[0]), msg)
        elif "max_steps" in msg:
            out.setdefault("max_steps", msg)
        else:
            general.append(msg)
    return out, general


def is_under(path: str | Path, root: str | Path) -> bool:
    """True when ``path`` resolves inside ``root`` (no escaping through .. or links)."""
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except (ValueError, OSError):
        return False
