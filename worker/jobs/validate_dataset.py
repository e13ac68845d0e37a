"""``validate_dataset`` jobs (CPU lane): the report of an upload, computed off the web process.

Payload: ``{"dataset_id", "mode": "sft" | "sft_or_prompts" | "prompts", "prompt_column"?,
"answer_column"?}`` (see :mod:`app.studio.validation`). Progress events (stage ``validate``)
say "validating n / N rows"; cancel (the dataset was deleted), a lost lease or a shutdown stop
the work at the next batch of rows. The dataset ends ``processed`` or ``error``; an unexpected
failure marks it ``error`` with the cause before the job fails.
"""
from __future__ import annotations

from typing import Any

from app.store import repo
from app.studio import validation
from worker.context import JobContext


def run(ctx: JobContext) -> dict[str, Any]:
    """Validate the dataset named in the payload; returns ``{"status", "rows"?, "error"?}``."""
    payload = ctx.payload

    def emit(done: int, total: int | None) -> None:
        of = f" / {total:,}" if total else ""
        ctx.progress("validate", done, total or 0, f"validating {done:,}{of} rows")

    try:
        return validation.validate(ctx.engine, ctx.settings, payload["dataset_id"], payload,
                                   emit, ctx.check)
    except Exception as exc:  # noqa: BLE001 - the dataset must not stay "validating" forever
        try:
            repo.update_dataset(ctx.engine, payload["dataset_id"], status=validation.ERROR,
                                error=f"validation failed: {type(exc).__name__}: {exc}"[:1000])
        except Exception:  # noqa: BLE001 - deleted meanwhile, or the database is locked
            pass
        raise
