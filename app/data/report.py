"""Dataset validation report (web preview) and the encoded stream (worker training).

Both go through :func:`iter_rows`, so the preview shows exactly what training sees.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Iterator

from pydantic import BaseModel

from .chat_template import DEFAULT_TEMPLATES, resolve_template
from .encode import (Encoded, Measured, Prepared, TokenizerBundle, encode_prepared_batch,
                     encode_with_bundle, load_tokenizer_bundle, prepare_example)
from .errors import DatasetError, RowIssue
from .formats import (apply_column_mapping, canonical_format, check_column_mapping, detect_format,
                      normalize_row)
from .loader import MAX_ROWS, file_kind, iter_records, txt_json_hint

DETECT_SAMPLE_ROWS = 100
#: Rows rendered, then tokenised together by the tokenizer's batch encoder.
ENCODE_BATCH_ROWS = 256


class Issue(BaseModel):
    """A problem (or warning) with a row: ``row`` is 1-based, None for the whole file."""

    row: int | None
    field: str | None
    message: str


class Bin(BaseModel):
    """Histogram bin of token lengths: ``lo <= length < hi`` (tokens, before truncation)."""

    lo: int
    hi: int
    count: int


class WarningGroup(BaseModel):
    """One warning repeated over rows: ``count`` rows (exact), the first ``rows`` of them."""

    field: str | None
    message: str
    count: int
    rows: list[int]


class PreviewRow(BaseModel):
    """A row as the model sees it: ``segments`` = [(text, trained)], after truncation."""

    row: int
    segments: list[tuple[str, bool]]
    num_tokens: int
    num_trained: int
    truncated: bool


class DatasetReport(BaseModel):
    """Everything the upload page shows about a dataset (``model_dump()`` is JSON-ready).

    Token counts are in tokens of the given tokenizer, before truncation.
    """

    format: str
    file_kind: str
    total_rows: int
    valid_rows: int
    invalid_rows: int
    errors: list[Issue]            # the first ``max_issues`` invalid rows
    warnings: list[Issue]          # the first ``max_issues`` warnings
    warning_count: int
    max_seq_length: int | None
    over_max_seq_length: int       # valid rows longer than max_seq_length (truncated)
    no_trained_tokens: int         # valid rows with no trained token after truncation
    untrained: list[Issue] = []    # the first ``max_issues`` of them, each with the reason
    warning_groups: list[WarningGroup] = []  # every row warning, grouped by field and message
    min_tokens: int
    max_tokens: int
    mean_tokens: float
    histogram: list[Bin]
    preview: list[PreviewRow]


@dataclass
class RowResult:
    """One row through the pipeline: either ``encoded`` or ``error`` is set."""

    row: int
    example: dict | None = None
    encoded: Encoded | Measured | None = None
    error: RowIssue | None = None
    warnings: list[RowIssue] = field(default_factory=list)


#: How :func:`untrained_reason` starts for a row cut before its answer.
PAST_LENGTH = "the answer starts past max_seq_length"
_PAST_ADVICE = ", so nothing of it is trained: raise max_seq_length or shorten the prompt"
_EMPTY_ADVICE = "; the row is dropped"


def untrained_reason(enc: Encoded, max_seq_length: int | None) -> str:
    """Why an encoded row has no trained token (training drops such a row)."""
    if enc.truncated and max_seq_length is not None:
        return (f"{PAST_LENGTH} ({max_seq_length} tokens; the row has "
                f"{enc.num_tokens}){_PAST_ADVICE}")
    return f"no token of the row is trained (the answer renders to nothing){_EMPTY_ADVICE}"


def untrained_cause(reason: str) -> str:
    """An :func:`untrained_reason` (as a stored report lists it) without its advice: the
    cause alone, e.g. "the answer starts past max_seq_length (512 tokens; the row has 1300)"."""
    return reason.removesuffix(_PAST_ADVICE).removesuffix(_EMPTY_ADVICE)


def _bundle(tokenizer: TokenizerBundle | str | os.PathLike) -> TokenizerBundle:
    return tokenizer if isinstance(tokenizer, TokenizerBundle) else load_tokenizer_bundle(tokenizer)


def iter_rows(path: str | os.PathLike, tokenizer: TokenizerBundle | str | os.PathLike,
              chat_template: str | None = None, max_seq_length: int | None = None,
              train_on_responses_only: bool = True, fmt: str | None = None,
              column_mapping: dict[str, str] | None = None,
              measure_only: bool = False,
              ) -> tuple[str, Iterator[RowResult]]:
    """Detect the format and return ``(format, iterator of RowResult)`` over all rows.

    ``chat_template``: a built-in name (see ``DEFAULT_TEMPLATES``), Jinja source, or None
    for the model's own.  Row problems are yielded as ``RowResult.error``.
    ``column_mapping`` (``{role: column}``, see
    :func:`app.data.formats.check_column_mapping`): the file's columns read as alpaca fields
    (the format is then ``alpaca``; errors name the file's own columns).
    ``measure_only``: ``RowResult.encoded`` is a :class:`app.data.encode.Measured` (token
    count, truncation, trained or not: what the report needs, ~40x cheaper a row), not the ids.

    Raises:
        DatasetError: whole-file problems (see :func:`app.data.loader.iter_records`), no
            detectable format, a bad template, or conversations with no template at all.
    """
    bundle = _bundle(tokenizer)
    template = resolve_template(chat_template, bundle.chat_template)
    records = iter_records(path)
    head = list(itertools.islice(records, DETECT_SAMPLE_ROWS))
    if not head:
        raise DatasetError("the file holds no rows")
    mapping = check_column_mapping(column_mapping)
    if mapping:
        fmt = "alpaca"
    readable = [r.data for r in head if r.data is not None]
    if not fmt and not readable:  # every sampled row was unreadable: say why, by row
        first = next(r for r in head if r.error is not None)
        raise DatasetError(f"no readable row to detect the format from; {first.error}")
    fmt = canonical_format(fmt) if fmt else detect_format(readable)

    def normalize(data: dict, row: int) -> tuple[dict, list]:
        if not mapping:
            return normalize_row(data, fmt, row)
        try:
            return normalize_row(apply_column_mapping(data, mapping), fmt, row)
        except DatasetError as err:  # name the file's column, not the alpaca field
            raise DatasetError(err.message, err.row, mapping.get(err.field, err.field)) from None
    if fmt in ("alpaca", "sharegpt", "messages", "oasst_tree") and not template:
        raise DatasetError(f"{fmt} rows need a chat template and the model has none; choose one "
                           f"of: {', '.join(DEFAULT_TEMPLATES)}")

    def results(batch: list) -> Iterator[RowResult]:
        """The batch's rows in order: problems as errors, the rest tokenised in one batch."""
        prepared: list[tuple[int, dict, list, Prepared]] = []
        out: dict[int, RowResult] = {}
        for rec in batch:
            if rec.error is not None:
                out[rec.row] = RowResult(rec.row, error=RowIssue.from_error(rec.error, rec.row))
                continue
            try:
                example, warns = normalize(rec.data, rec.row)
                prep = prepare_example(example, template or bundle.chat_template,
                                       bos_token=bundle.bos_token, eos_token=bundle.eos_token,
                                       special_tokens=bundle.special_tokens)
            except DatasetError as err:
                out[rec.row] = RowResult(rec.row, error=RowIssue.from_error(err, rec.row))
                continue
            prepared.append((rec.row, example, warns, prep))
        encoded = encode_prepared_batch([p[3] for p in prepared], bundle,
                                        max_seq_length=max_seq_length,
                                        train_on_responses_only=train_on_responses_only,
                                        measure_only=measure_only)
        for (row, example, warns, _), enc in zip(prepared, encoded):
            out[row] = RowResult(row, example, enc, None, warns)
        for rec in batch:
            yield out[rec.row]

    def gen() -> Iterator[RowResult]:
        chain = itertools.chain(head, records)
        while batch := list(itertools.islice(chain, ENCODE_BATCH_ROWS)):
            yield from results(batch)

    return fmt, gen()


def counted(items, on_rows=None, every: int = ENCODE_BATCH_ROWS):
    """``items`` unchanged, calling ``on_rows(n)`` every ``every`` items and at the end; over
    :data:`app.data.loader.MAX_ROWS` items raises DatasetError."""
    n = 0
    for item in items:
        n += 1
        if n > MAX_ROWS:
            raise DatasetError(f"the file holds more than {MAX_ROWS:,} rows; split it")
        if on_rows is not None and n % every == 0:
            on_rows(n)
        yield item
    if on_rows is not None:
        on_rows(n)


def _nice_width(span: int, max_bins: int) -> int:
    raw = max(1, math.ceil(span / max_bins))
    base = 10 ** int(math.floor(math.log10(raw)))
    for mult in (1, 2, 5, 10):
        if base * mult >= raw:
            return base * mult
    return base * 10


def token_histogram(lengths: list[int], max_bins: int = 16) -> list[Bin]:
    """Equal-width bins with a round width (1, 2, 5 × 10^k) from 0 to the longest length."""
    if not lengths:
        return []
    width = _nice_width(max(lengths) + 1, max_bins)
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n // width] = counts.get(n // width, 0) + 1
    return [Bin(lo=b * width, hi=(b + 1) * width, count=counts.get(b, 0))
            for b in range(max(counts) + 1)]


def inspect_dataset(path: str | os.PathLike, tokenizer: TokenizerBundle | str | os.PathLike,
                    chat_template: str | None = None, max_seq_length: int | None = 2048,
                    train_on_responses_only: bool = True, fmt: str | None = None,
                    preview_rows: int = 5, max_issues: int = 100,
                    raise_if_empty: bool = True, on_rows=None,
                    column_mapping: dict[str, str] | None = None) -> DatasetReport:
    """Validate a whole dataset file and build its :class:`DatasetReport`.

    Args:
        path: the dataset file.
        tokenizer: a :class:`TokenizerBundle` or a HF model folder.
        chat_template: built-in template name, Jinja source, or None (the model's).
        max_seq_length: tokens; rows above it are counted (and truncated in the preview).
        train_on_responses_only: mask prompts (see :mod:`app.data.encode`).
        fmt: force a format (see ``app.data.formats.FORMATS``) instead of detecting it.
        preview_rows: how many valid rows to render for the preview.
        max_issues: cap on listed errors and warnings (the counts are exact).
        raise_if_empty: raise when no row is valid, naming the first bad row and field.
        on_rows: called with the rows read so far every :data:`ENCODE_BATCH_ROWS` rows (it may
            raise to stop the work: a time budget, a cancelled job).
        column_mapping: the file's columns as alpaca fields (see :func:`iter_rows`).

    Raises:
        DatasetError: whole-file problems, or (``raise_if_empty``) no valid row at all.
    """
    bundle = _bundle(tokenizer)
    template = resolve_template(chat_template, bundle.chat_template)
    fmt, rows = iter_rows(path, bundle, chat_template, max_seq_length,
                          train_on_responses_only, fmt, column_mapping, measure_only=True)
    total = valid = over = untrained = warning_count = 0
    errors: list[Issue] = []
    untrained_rows: list[Issue] = []
    groups: dict[tuple[str | None, str], WarningGroup] = {}
    first_error: RowIssue | None = None
    warnings: list[Issue] = []
    lengths: list[int] = []
    preview: list[PreviewRow] = []
    for res in counted(rows, on_rows):
        total += 1
        if res.error is not None:
            first_error = first_error or res.error
            if len(errors) < max_issues:
                errors.append(Issue(row=res.error.row, field=res.error.field, message=res.error.message))
            continue
        valid += 1
        enc = res.encoded
        lengths.append(enc.num_tokens)
        over += int(max_seq_length is not None and enc.num_tokens > max_seq_length)
        if not enc.trained:
            untrained += 1
            if len(untrained_rows) < max_issues:
                untrained_rows.append(Issue(row=res.row, field=None,
                                            message=untrained_reason(enc, max_seq_length)))
        for w in res.warnings:
            warning_count += 1
            if len(warnings) < max_issues:
                warnings.append(Issue(row=w.row, field=w.field, message=w.message))
            group = groups.setdefault((w.field, w.message), WarningGroup(
                field=w.field, message=w.message, count=0, rows=[]))
            group.count += 1
            if len(group.rows) < max_issues:
                group.rows.append(w.row)
        if len(preview) < preview_rows:
            full = encode_with_bundle(res.example, bundle, template, max_seq_length=max_seq_length,
                                      train_on_responses_only=train_on_responses_only)
            preview.append(PreviewRow(row=res.row, segments=full.segments, num_tokens=full.num_tokens,
                                      num_trained=full.num_trained, truncated=full.truncated))
    hint = txt_json_hint(path) if file_kind(path) == "txt" else None
    if hint:
        warning_count += 1
        warnings.insert(0, Issue(row=None, field=None, message=hint))
    if valid == 0 and raise_if_empty and first_error is not None:
        every = "the only row is invalid" if total == 1 else f"all {total} rows are invalid"
        raise DatasetError(f"{first_error.message} (no usable rows: {every})",
                           row=first_error.row, field=first_error.field)
    return DatasetReport(
        format=fmt, file_kind=file_kind(path), total_rows=total, valid_rows=valid,
        invalid_rows=total - valid, errors=errors, warnings=warnings, warning_count=warning_count,
        max_seq_length=max_seq_length, over_max_seq_length=over, no_trained_tokens=untrained,
        untrained=untrained_rows, warning_groups=list(groups.values()),
        min_tokens=min(lengths, default=0), max_tokens=max(lengths, default=0),
        mean_tokens=round(sum(lengths) / len(lengths), 2) if lengths else 0.0,
        histogram=token_histogram(lengths), preview=preview)


def iter_encoded(path: str | os.PathLike, tokenizer: TokenizerBundle | str | os.PathLike,
                 chat_template: str | None = None, max_seq_length: int | None = 2048,
                 train_on_responses_only: bool = True, fmt: str | None = None,
                 skip_untrained: bool = True, column_mapping: dict[str, str] | None = None,
                 dropped: list[Issue] | None = None) -> Iterator[tuple[int, Encoded]]:
    """The training set: ``(row, Encoded)`` for each valid row, in file order.

    Invalid rows are skipped (the report lists them); so are rows with no trained token
    when ``skip_untrained``, each appended to ``dropped`` (when given) with its row number and
    reason, as the report lists them.  Same arguments and errors as :func:`inspect_dataset`.
    """
    _, rows = iter_rows(path, tokenizer, chat_template, max_seq_length, train_on_responses_only,
                        fmt, column_mapping)
    for res in rows:
        if res.encoded is None:
            continue
        if skip_untrained and res.encoded.num_trained == 0:
            if dropped is not None:
                dropped.append(Issue(row=res.row, field=None,
                                     message=untrained_reason(res.encoded, max_seq_length)))
            continue
        yield res.row, res.encoded


