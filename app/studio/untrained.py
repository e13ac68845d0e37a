"""An SFT dataset whose validation report shows that a run cannot train on it: every valid row
has no trained token (the answer starts past ``max_seq_length``, or renders to nothing), so the
worker would find nothing to train on and fail the run after its wait in the queue.

The report's counts depend on what the rows are encoded with: the tokenizer (the model's, or
the GPT-2 stand-in before any model was ready), the chat template, ``train_on_responses_only``
(a report is always made with it on), the format, the column mapping and ``max_seq_length``.
A run is refused only when it encodes the rows as the report did, up to a ``max_seq_length``
no longer than the report's (a row whose answer starts past N tokens starts past every
shorter length too); any other run is accepted, and the worker still checks.
"""
from __future__ import annotations

from typing import Any

from app.data.report import PAST_LENGTH, untrained_cause
from app.store.schema import Dataset, Model
from app.studio.datasets import context_window
from app.studio.errors import invalid


def untrained_count(ds: Dataset) -> int | None:
    """The valid rows of a processed SFT dataset when its stored report finds a trained token
    in none of them (at the report's ``max_seq_length``); None otherwise or when not known (a
    report made without a tokenizer, or no valid row)."""
    report = ds.report or {}
    valid = report.get("valid_rows")
    if ds.status != "processed" or ds.format == "prompts" or not report.get("tokenized"):
        return None
    if not isinstance(valid, int) or valid < 1 or report.get("no_trained_tokens") != valid:
        return None
    return valid


def report_note(ds: Dataset) -> str | None:
    """What a run form's dataset picker says of a dataset none of whose rows has a trained
    token in its report ("no row has a trained token at max_seq_length 512"); None otherwise."""
    if untrained_count(ds) is None:
        return None
    return f"no row has a trained token at max_seq_length {ds.report.get('max_seq_length')}"


def _same_encoding(report: dict[str, Any], model: Model, spec) -> bool:
    """Whether ``spec`` (template resolved, the dataset's column mapping filled in) encodes the
    rows as ``report`` did, at a ``max_seq_length`` no longer than the report's."""
    length = report.get("max_seq_length")
    return (report.get("model_id") == model.id and report.get("tokenizer") == model.name
            and not spec.add_template_tokens and spec.train_on_responses_only
            and report.get("template_name") == spec.chat_template_name != "custom"
            and spec.dataset_format in (None, "", report.get("format"))
            and (spec.column_mapping or None) == (report.get("column_mapping") or None)
            and isinstance(length, int) and spec.max_seq_length <= length)


def check_trainable(ds: Dataset, model: Model, spec) -> None:
    """Refuse an SFT run on ``ds`` when its validation report shows that no row has a trained
    token with the run's settings (see the module docstring for when the report applies).

    Raises StudioError(invalid, ``dataset``) saying why, on which row, and what to change."""
    valid = untrained_count(ds)
    report = ds.report or {}
    if valid is None or not _same_encoding(report, model, spec):
        return
    n = spec.max_seq_length
    first = (report.get("untrained") or [{}])[0]
    reason = first.get("message") or ""
    count = "its only row" if valid == 1 else f"all {valid:,} valid rows"
    row = f"; row {first['row']}: {untrained_cause(reason)}" if first.get("row") else ""
    raise invalid("dataset", f"no row of dataset {ds.filename!r} has a trained token at "
                  f"max_seq_length {n} (its validation report with {model.name}'s tokenizer "
                  f"and the {spec.chat_template_name} chat template: {count}{row}); "
                  f"{_advice(reason, n, model)}")


def _advice(reason: str, n: int, model: Model | None) -> str:
    """What to change when no row has a trained token at ``max_seq_length`` ``n`` (``reason``:
    the first such row's report message)."""
    context = context_window(model) if model is not None else None
    if not reason.startswith(PAST_LENGTH):
        return ("check the format and the chat template on the dataset's page, or set "
                "train_on_responses_only false to train on every token")
    if context and n >= context:
        return (f"shorten the prompts: max_seq_length {n} is already {model.name}'s context "
                "window")
    return (f"raise max_seq_length (up to {context}) or shorten the prompts" if context
            else "raise max_seq_length or shorten the prompts")


def report_banner(report: dict[str, Any] | None, model: Model | None) -> str | None:
    """What the dataset page says above an SFT validation ``report`` (the stored one, or one
    made for the page's model, template and length; ``model`` the one chosen) in which no
    valid row has a trained token: a run with those settings would be refused, so the page
    says why and what to change rather than only "processed" (trial s24). None otherwise."""
    report = report or {}
    valid, n = report.get("valid_rows"), report.get("max_seq_length")
    if report.get("format") == "prompts" or not report.get("tokenized") \
            or not isinstance(valid, int) or valid < 1 or report.get("no_trained_tokens") != valid:
        return None
    first = (report.get("untrained") or [{}])[0]
    reason = first.get("message") or ""
    count = "its only valid row has no" if valid == 1 else f"none of its {valid:,} valid rows has a"
    row = f" (row {first['row']}: {untrained_cause(reason)})" if first.get("row") else ""
    with_what = f" with {report['tokenizer']}'s tokenizer" if report.get("tokenizer") else ""
    template = f" and the {report['template_name']} chat template" \
        if report.get("template_name") else ""
    return (f"Nothing to train on with these settings: {count} trained token at "
            f"max_seq_length {n}{with_what}{template}{row}, so a run with them is refused. "
            f"To train: {_advice(reason, n if isinstance(n, int) else 0, model)}.")
