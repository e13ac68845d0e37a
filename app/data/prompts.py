"""Prompt datasets for GRPO: which column is the prompt, which the reference, and a report.

A GRPO dataset needs no answers to train on, only prompts (and whatever columns the rewards
read), so it is not one of the SFT formats: GSM8K's ``question`` + ``answer`` rows are a prompt
dataset. A row's prompt is its ``prompt_column`` (default: the first of
:data:`app.store.specs.PROMPT_COLUMNS` present) or, in the OpenAI reinforcement fine-tuning
layout, its ``messages`` (the conversation up to its last user turn, which the model answers;
the report warns about rows that go on after it). Used by the web upload check and by the worker
(:mod:`worker.engine.grpo`), so both agree.
"""
from __future__ import annotations

import os
from typing import Any

from app.data.answers import NumberCount
from app.data.errors import DatasetError
from app.data.loader import iter_records

MESSAGES = "messages"


class ColumnError(DatasetError):
    """A prompt or reference column that is missing from the rows: ``option`` names the upload
    option that fixes it (``prompt_column`` or ``answer_column``), for the form to show the
    message at that field. ``str()`` is the message, as a DatasetError's without a location."""

    def __init__(self, message: str, option: str):
        super().__init__(message)
        self.option = option


def pick_columns(row: dict, prompt_column: str | None = None,
                 answer_column: str | None = None) -> tuple[str, str | None]:
    """(prompt column, reference column or None) for rows shaped like ``row``.

    Raises ColumnError (a DatasetError) naming the columns the row has when a named column is
    missing or no prompt column can be found.
    """
    from app.store.specs import ANSWER_COLUMNS, PROMPT_COLUMNS

    have = ", ".join(row) or "none"
    if prompt_column:
        if prompt_column not in row:
            raise ColumnError(f"the dataset has no prompt column {prompt_column!r} "
                              f"(columns: {have})", "prompt_column")
        pcol = prompt_column
    else:
        pcol = next((c for c in (*PROMPT_COLUMNS, MESSAGES) if c in row), None)
        if pcol is None:
            raise ColumnError(f"no prompt column found (looked for "
                              f"{', '.join((*PROMPT_COLUMNS, MESSAGES))}); name it with "
                              f"prompt_column (columns: {have})", "prompt_column")
    if answer_column:
        if answer_column not in row:
            raise ColumnError(f"the dataset has no reference column {answer_column!r} "
                              f"(columns: {have})", "answer_column")
        return pcol, answer_column
    return pcol, next((c for c in ANSWER_COLUMNS if c in row and c != pcol), None)


def prompt_messages(value: Any, column: str, system_prompt: str | None = None) -> list[dict] | None:
    """The chat messages of one row's prompt cell, or None when the row has no usable prompt.

    A string becomes ``[system?, user]``. A ``messages`` list (roles made canonical) is cut
    after its last user turn: the model writes the reply to it, so a chat dataset whose rows end
    on the assistant's answer serves as prompts too (the upload report warns how many rows go
    on after their last user turn). None when :func:`message_problem` finds a problem:
    the row is left out, as the upload report lists it. A system prompt is added only when the
    messages have none. Raises DatasetError on other shapes.
    """
    from app.data.formats import message_role

    if isinstance(value, str):
        if not value.strip():
            return None
        msgs = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        if not value or message_problem(value, column) is not None:
            return None
        msgs = [{"role": message_role(m, column), "content": str(m.get("content") or "")}
                for m in value]  # a user turn is there: message_problem checked
        msgs = msgs[:max(i for i, m in enumerate(msgs) if m["role"] == "user") + 1]
    elif value is None:
        return None
    else:
        raise DatasetError(f"the prompt column {column!r} holds a {type(value).__name__}; "
                           f"it must be text or a list of messages")
    if system_prompt and not any(m["role"] == "system" for m in msgs):
        msgs = [{"role": "system", "content": system_prompt}, *msgs]
    return msgs


def message_problem(value: Any, column: str) -> tuple[str, str] | None:
    """``(field, reason)`` of the first problem of a ``messages`` prompt cell (a role that is
    not system/user/assistant/tool, an assistant turn with no content, no user turn at all),
    else None (also for a text cell and an empty list). The shape and role are the SFT
    check's (:func:`app.data.formats.message_role`)."""
    from app.data.formats import message_role

    if not isinstance(value, list):
        return None
    roles = []
    for i, msg in enumerate(value):
        try:
            roles.append(message_role(msg, f"{column}[{i}]"))
        except DatasetError as exc:
            return exc.field, exc.message
        content = msg.get("content")
        if roles[-1] == "assistant" and not msg.get("tool_calls") \
                and (content is None or (isinstance(content, str) and not content.strip())):
            return f"{column}[{i}].content", "the assistant turn has no content"
    if roles and "user" not in roles:
        return column, "the messages have no user turn for the model to answer"
    return None


def inspect_prompts(path: str | os.PathLike, prompt_column: str | None = None,
                    answer_column: str | None = None, preview: int = 3,
                    on_rows=None) -> dict[str, Any]:
    """A report for a prompt dataset: rows, usable rows, columns, the prompt and reference
    columns and a preview; ``on_rows(n)`` is called as rows are read (it may raise to stop).
    Rows whose messages are malformed (:func:`message_problem`) are listed in ``invalid``
    (``{row, field, message}``), as the SFT report lists its invalid rows; rows whose messages
    go on after their last user turn (the turns after it are left out of the prompt) are
    counted in one ``warnings`` entry (``{row: the first, field, message}``); ``numbers`` says which
    other columns hold a reference number in every row (:class:`app.data.answers.NumberCount`).
    Raises DatasetError when no row is readable or has a prompt (naming the first invalid row's
    row and field when there is one)."""
    rows = bad = usable = 0
    invalid: list[dict] = []
    first: dict | None = None
    columns: set[str] = set()
    previews: list[dict] = []
    pcol = acol = None
    numbers: NumberCount | None = None
    cut: list[tuple[int, str]] = []  # (row, field) of rows whose prompt leaves turns out
    from app.data.report import counted

    for rec in counted(iter_records(path), on_rows):
        rows += 1
        if rec.data is None:
            bad += 1
            continue
        if first is None:
            first = rec.data
            pcol, acol = pick_columns(first, prompt_column, answer_column)
            numbers = NumberCount({pcol})
        columns.update(rec.data)
        numbers.add(rec.row, rec.data)
        problem = message_problem(rec.data.get(pcol), pcol)
        if problem is not None:
            invalid.append({"row": rec.row, "field": problem[0], "message": problem[1]})
        cell = rec.data.get(pcol)
        try:
            prompt = prompt_messages(cell, pcol) if problem is None else None
        except DatasetError:
            prompt = None
        ok = prompt is not None
        usable += ok
        if ok and isinstance(cell, list) and len(prompt) < len(cell):  # turns left out
            cut.append((rec.row, f"{pcol}[{len(prompt)}]"))
        if ok and len(previews) < preview:
            previews.append({k: v[:500] if isinstance(v, str) else v
                             for k, v in rec.data.items()})
    if first is None:
        raise DatasetError("the file has no readable rows")
    if not usable and invalid:
        first_bad = invalid[0]
        raise DatasetError(f"{first_bad['message']} (no row of column {pcol!r} has a usable "
                           f"prompt)", row=first_bad["row"], field=first_bad["field"])
    if not usable:
        raise DatasetError(f"no row has a non-empty prompt in column {pcol!r}")
    whose = "1 row's" if len(cut) == 1 else f"{len(cut):,} rows'"
    warnings = [] if not cut else [{
        "row": cut[0][0], "field": cut[0][1],
        "message": f"{whose} messages go on after the last user turn (the first: row "
                   f"{cut[0][0]}); each prompt is the conversation up to its last user turn, "
                   "which the model answers; the turns after it are left out"}]
    return {"format": "prompts", "rows": rows, "valid_rows": usable, "unreadable_rows": bad,
            "invalid_rows": rows - usable, "invalid": invalid, "warnings": warnings,
            "columns": sorted(columns), "prompt_column": pcol, "answer_column": acol,
            "prompt_preview": previews, "numbers": numbers.report()}
