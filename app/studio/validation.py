"""Validating an upload in the background: the dataset row exists at once (``validating``), a
``validate_dataset`` job on the worker's CPU lane computes the report, writes progress as job
events ("validating n / N rows", shown live on the dataset page) and ends the row ``processed``
or ``error``.

The web only streams the bytes to disk and calls :func:`start`; the worker's job calls
:func:`validate`. A validation that runs past ``settings.validate_timeout_seconds`` stops with a
clear error; deleting the dataset cancels its job, which stops at the next batch of rows.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.data.errors import DatasetError
from app.settings import Settings
from app.store import queue, repo
from app.store.schema import Dataset, JobState
from app.studio import audit
from app.studio.job_states import state_words

if TYPE_CHECKING:
    from app.store.schema import User

VALIDATING, PROCESSED, ERROR = "validating", "processed", "error"
JOB_KIND = "validate_dataset"
#: How often (seconds) the dataset row's ``report`` records the progress that run creation quotes.
ROW_PROGRESS_SECONDS = 2.0


def estimate_rows(path: str | Path, parquet: bool = True) -> int | None:
    """The number of rows a file holds, cheaply (no parsing): Parquet from its metadata; JSON
    Lines, CSV and text from the count of non-empty lines (an upper bound when fields span
    lines); None for a JSON document.

    ``parquet=False`` (the web process): None for Parquet, which needs pyarrow, a library the
    web does not load (its first import holds the interpreter for seconds on a cold disk, while
    other requests wait); the validation job reads it from the footer when it starts."""
    ext = os.path.splitext(str(path))[1].lower()
    try:
        if ext == ".parquet":
            if not parquet:
                return None
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        if ext not in (".jsonl", ".ndjson", ".csv", ".tsv", ".txt"):
            return None
        lines = blank = 0
        with open(path, "rb") as fh:
            prev = b"\n"
            while chunk := fh.read(1 << 20):
                lines += chunk.count(b"\n")
                blank += chunk.count(b"\n\n") + (prev == b"\n" and chunk[:1] == b"\n")
                prev = chunk[-1:]
        rows = lines + (prev != b"\n") - blank
        return max(0, rows - (1 if ext in (".csv", ".tsv") else 0))
    except Exception:  # noqa: BLE001 - an estimate only; the job reports the real count
        return None


def start(engine: Engine, actor: User, ds_id: str, final: Path, filename: str, size: int,
          purpose: str, options: dict[str, Any]) -> Dataset:
    """Record the received file ``final`` as a dataset in state ``validating`` owned by
    ``actor`` and queue its ``validate_dataset`` job; returns the row at once.

    ``options``: ``mode`` (``sft``, ``sft_or_prompts`` or ``prompts``), ``prompt_column``,
    ``answer_column``."""
    total = estimate_rows(final, parquet=False)
    ds = Dataset(id=ds_id, filename=filename, path=str(final.resolve()), bytes=size,
                 purpose=purpose, status=VALIDATING, owner=actor.id,
                 report={"validating": {"done": 0, "total": total}})
    repo.add_dataset(engine, ds)
    job = queue.enqueue(engine, JOB_KIND, {"dataset_id": ds_id, **options}, max_attempts=2,
                        owner=actor.id)
    ds = repo.update_dataset(engine, ds_id,
                             report={"validating": {"done": 0, "total": total, "job_id": job.id}})
    audit.record(engine, actor.id, "dataset.uploaded", "dataset", ds.id, filename=filename,
                 bytes=size, purpose=purpose)
    return ds


def restart(engine: Engine, ds: Dataset, options: dict[str, Any]) -> Dataset:
    """Validate ``ds`` again with new ``options`` (see :func:`start`; a ``column_mapping``):
    the row goes back to ``validating`` and a new ``validate_dataset`` job is queued."""
    total = estimate_rows(ds.path, parquet=False)
    job = queue.enqueue(engine, JOB_KIND, {"dataset_id": ds.id, **options}, max_attempts=2,
                        owner=ds.owner)
    return repo.update_dataset(engine, ds.id, status=VALIDATING, error=None,
                               report={"validating": {"done": 0, "total": total,
                                                      "job_id": job.id}})


def job_id(ds: Dataset) -> int | None:
    """The id of the job validating ``ds`` (also kept once it is done), or None."""
    info = (ds.report or {}).get("validating") or {}
    jid = info.get("job_id", (ds.report or {}).get("validation_job_id"))
    return jid if isinstance(jid, int) else None


def progress_text(ds: Dataset) -> str:
    """``"still validating, 1,024/120,000 rows"`` (``/?`` while the total is unknown)."""
    info = (ds.report or {}).get("validating") or {}
    total = info.get("total")
    return (f"still validating, {info.get('done') or 0:,}/"
            f"{f'{total:,}' if isinstance(total, int) else '?'} rows")


def check_stale(engine: Engine, ds: Dataset) -> Dataset:
    """A dataset still ``validating`` whose job ended without recording a result (its worker
    died for good, or it was cancelled) becomes ``error`` with the job's reason; others are
    returned unchanged."""
    jid = job_id(ds)
    if ds.status != VALIDATING or jid is None:
        return ds
    try:
        job = queue.get_job(engine, jid)
    except queue.JobNotFound:
        return ds
    if job.state not in JobState.FINAL:
        return ds
    ds = repo.get_dataset(engine, ds.id)  # the job may have just written its result
    if ds.status != VALIDATING:
        return ds
    reason = job.error or f"the validation job {state_words(job.state)}"
    return repo.update_dataset(engine, ds.id, status=ERROR, error=f"validation stopped: {reason}")


class Progress:
    """The callback a report calls with the rows read so far: it writes the progress (job
    events through ``emit``, the dataset row every :data:`ROW_PROGRESS_SECONDS`), calls
    ``check`` (raises to stop: cancel, lost lease, shutdown) and enforces the time budget."""

    def __init__(self, engine: Engine, ds: Dataset, total: int | None, budget_s: float,
                 emit: Callable[[int, int | None], None], check: Callable[[], None]):
        self.engine, self.ds, self.total, self.budget = engine, ds, total, budget_s
        self.emit, self.check = emit, check
        self.t0 = self.last_row_write = time.monotonic()
        self.done = 0

    def __call__(self, done: int) -> None:
        self.check()
        self.done = done
        total = self.total if self.total is None or self.total >= done else None
        self.emit(done, total)
        elapsed = time.monotonic() - self.t0
        if elapsed > self.budget:
            raise DatasetError(f"validation stopped after {self.budget:.0f} s at row {done:,} "
                               "(the time budget, WHETSTONE_VALIDATE_TIMEOUT_SECONDS); split the "
                               "file or ask the admin for a longer budget")
        if time.monotonic() - self.last_row_write >= ROW_PROGRESS_SECONDS:
            self.last_row_write = time.monotonic()
            info = {**((self.ds.report or {}).get("validating") or {}), "done": done,
                    "total": total}
            repo.update_dataset(self.engine, self.ds.id, report={"validating": info})


def validate(engine: Engine, settings: Settings, dataset_id: str, options: dict[str, Any],
             emit: Callable[[int, int | None], None], check: Callable[[], None]) -> dict[str, Any]:
    """The body of a ``validate_dataset`` job: compute the report of the dataset's file with
    the tokenizer and template a run would use, and end the row ``processed`` (with the report)
    or ``error`` (with the message naming the row and field). Returns a summary for the job.

    ``emit(done, total)`` receives the progress; ``check()`` raises to stop the work (the
    dataset stays ``validating`` for the caller to settle). A dataset deleted meanwhile is
    skipped."""
    from app.studio import datasets as uc

    try:
        ds = repo.get_dataset(engine, dataset_id)
    except repo.NotFound:
        return {"skipped": "the dataset was deleted"}
    info = (ds.report or {}).get("validating") or {}
    total = info.get("total")
    if total is None and (total := estimate_rows(ds.path)) is not None:
        try:  # the count the web left out (Parquet): shown from the job's start
            ds = repo.update_dataset(engine, ds.id, report={"validating": {**info, "total": total}})
        except repo.NotFound:
            return {"skipped": "the dataset was deleted"}
    progress = Progress(engine, ds, total, settings.validate_timeout_seconds, emit, check)
    jid = job_id(ds)
    try:
        report, purpose = uc.compute_report(engine, settings, ds, options, progress)
    except repo.NotFound:
        return {"skipped": "the dataset was deleted"}
    except DatasetError as exc:
        mapping = options.get("column_mapping")
        _settle(engine, ds.id, status=ERROR, error=str(exc),
                report={"validation_job_id": jid, "rows_read": progress.done,
                        **({"column_mapping": mapping} if mapping else {}),
                        **_prompt_upload(options, exc)})
        return {"status": ERROR, "error": str(exc)}
    rows = report.get("valid_rows") or report.get("rows")
    _settle(engine, ds.id, status=PROCESSED, error=None, format=report.get("format"), rows=rows,
            purpose=purpose, report={**report, "validation_job_id": jid})
    return {"status": PROCESSED, "rows": rows, "format": report.get("format"),
            "invalid_rows": report.get("invalid_rows") or 0}


def _prompt_upload(options: dict[str, Any], exc: DatasetError) -> dict[str, Any]:
    """For a failed GRPO prompt upload (mode ``prompts``): ``{"upload": {prompt_column,
    answer_column, error_field}}``, the columns asked for and the option the error is about
    (:class:`app.data.prompts.ColumnError`, else None), for its page to offer the upload again
    with the message at that field; ``{}`` for other modes."""
    if options.get("mode") != "prompts":
        return {}
    return {"upload": {"prompt_column": options.get("prompt_column") or "",
                       "answer_column": options.get("answer_column") or "",
                       "error_field": getattr(exc, "option", None)}}


def _settle(engine: Engine, dataset_id: str, **fields: Any) -> None:
    """Write a validation's outcome (nothing when the dataset was deleted meanwhile)."""
    try:
        repo.update_dataset(engine, dataset_id, **fields)
    except repo.NotFound:
        pass
