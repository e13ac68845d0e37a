"""The training set, encoded by ``app.data`` exactly as the web preview shows it.

This module is the worker's only door to the dataset layer: rows are read, normalised, rendered
with the chat template and tokenised into ``input_ids`` + ``labels`` (-100 on untrained tokens)
by :func:`app.data.report.iter_encoded`; here they only become a ``datasets.Dataset``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

@dataclass
class ChosenTemplate:
    """The chat template a run actually uses: ``name`` (built-in, ``model``, ``custom``, ``none``)."""

    name: str
    source: str | None
    note: str | None = None


def choose_template(spec, model_template: str | None) -> ChosenTemplate:
    """The run's chat template as resolved when the run was created (``spec.chat_template_name``
    and ``spec.chat_template``); the worker never decides again.

    A spec written before runs stored the resolution (no ``chat_template_name``) is resolved
    with the same rule the web uses (:func:`app.data.chat_template.choose_template`), and
    ``note`` says which template that gave, for a log event. A custom or model template is
    checked in a child process under a time and memory budget (a spec stored before that check
    existed could freeze this process while compiling). Raises DatasetError on Jinja that does
    not compile, fails a sample chat or runs over the budget.
    """
    from app.data.chat_template import DEFAULT_TEMPLATES
    from app.data.chat_template import choose_template as resolve
    from app.data.errors import DatasetError
    from app.data.template_check import template_problem

    if getattr(spec, "chat_template_name", None):
        if spec.chat_template_name not in DEFAULT_TEMPLATES:  # checked again, within a budget
            problem = template_problem(spec.chat_template)
            if problem:
                raise DatasetError(f"chat_template: {problem}")
        return ChosenTemplate(spec.chat_template_name, spec.chat_template)
    name, source = resolve(spec.chat_template, model_template)
    note = None
    if not spec.chat_template and not model_template:
        note = (f"the model has no chat template and the run chose none; using the built-in "
                f"{name!r} template")
    return ChosenTemplate(name, source, note)


@dataclass
class EncodedSet:
    """Encoded rows plus counts for config.json and the log."""

    dataset: object  # datasets.Dataset with input_ids, labels
    rows: int
    tokens: int
    trained_tokens: int
    truncated: int
    dropped: list = field(default_factory=list)  # app.data.report.Issue: rows with no trained token
    row_numbers: list = field(default_factory=list)  # the file's row number of each encoded row

    @property
    def read(self) -> int:
        """Valid rows read: the encoded ``rows`` plus the ``dropped`` ones."""
        return self.rows + len(self.dropped)


def tokenize_done(enc: EncodedSet) -> tuple[int, int, str]:
    """The ``tokenize`` stage's last progress event, ``(done, total, message)``: the valid rows
    read out of the same count (the total :func:`build_dataset`'s progress counted against, so
    the bar ends full instead of jumping to a smaller total), and the rows kept of them."""
    left = len(enc.dropped)
    note = f", {left:,} left out (no trained token)" if left else ""
    return enc.read, enc.read, f"{enc.rows:,} of {enc.read:,} rows to train on{note}"


def build_dataset(path: str | Path, model_dir: str | Path, template: str | None,
                  max_seq_length: int, train_on_responses_only: bool, fmt: str | None = None,
                  check: Callable[[], None] | None = None,
                  progress: Callable[[int], None] | None = None,
                  column_mapping: dict[str, str] | None = None) -> EncodedSet:
    """Encode every valid row of ``path`` for the model in ``model_dir``.

    ``check`` is called every 64 rows (raises to stop), ``progress(rows_read)`` likewise with
    the valid rows read so far (kept or not: the count the dataset's ``rows`` holds, so it
    never outruns that total). Rows with no trained token are left out and listed in
    ``EncodedSet.dropped`` (row, reason).
    ``column_mapping``: the dataset's columns read as alpaca fields (as the preview reads them).
    Raises DatasetError for whole-file problems (or when no row is trainable).
    """
    from datasets import Dataset

    from app.data.encode import load_tokenizer_bundle
    from app.data.errors import DatasetError
    from app.data.report import iter_encoded

    bundle = load_tokenizer_bundle(model_dir)
    ids, labels = [], []
    tokens = trained = truncated = 0
    dropped: list = []
    row_numbers: list[int] = []
    reported = 0
    for _row, enc in iter_encoded(path, bundle, template, max_seq_length,
                                  train_on_responses_only, fmt, column_mapping=column_mapping,
                                  dropped=dropped):
        row_numbers.append(_row)
        ids.append(list(enc.input_ids))
        labels.append(list(enc.labels))
        tokens += len(enc.input_ids)
        trained += sum(1 for x in enc.labels if x != -100)
        truncated += bool(enc.truncated)
        read = len(row_numbers) + len(dropped)
        if read - reported >= 64:
            reported = read
            if check:
                check()
            if progress:
                progress(read)
    if not ids:
        raise DatasetError("no row of the dataset has a trained token; check the format and "
                           "the chat template")
    return EncodedSet(Dataset.from_dict({"input_ids": ids, "labels": labels}), len(ids), tokens,
                      trained, truncated, dropped, row_numbers=row_numbers)


def dropped_note(dropped: list, shown: int = 5, listed: int = 200
                 ) -> tuple[str, list[str]] | None:
    """The run log's warning about rows left out for having no trained token, as ``(summary,
    details)``: the count, the first ``shown`` row numbers and the first row's reason; then one
    line per row (at most ``listed``), which the run page folds away. None when none was."""
    if not dropped:
        return None
    n, s = len(dropped), "s" if len(dropped) > 1 else ""
    rows = ", ".join(str(issue.row) for issue in dropped[:shown])
    more = f" and {n - shown} more" if n > shown else ""
    summary = (f"{n} row{s} with no trained token left out of training (row{s} {rows}{more}); "
               f"row {dropped[0].row}: {dropped[0].message}")
    details = [f"row {issue.row}: {issue.message}" for issue in dropped[:listed]]
    if n > listed:
        details.append(f"… and {n - listed} more rows")
    return summary, details


def row_lengths(dataset) -> list[int]:
    """Tokens per row of an encoded ``datasets.Dataset`` (its ``input_ids``), read from the Arrow
    column (the index mapping of a selected or filtered set honoured) without making
    Python lists of the ids."""
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
