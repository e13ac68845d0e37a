"""Errors of the dataset layer.

Every problem a user can cause with a dataset file is reported as a :class:`DatasetError`
(or, per row, as a :class:`RowIssue` collected in a report) — never as a traceback.

Row numbers are **1-based**, as a user counts them: row 1 is the first record of a JSON
array / JSONL file, the first data row of a CSV or Parquet file (the header is not a row),
or the first document of a .txt file.  Field paths use the names of the file's own
columns, e.g. ``conversations[1].value`` (list indices are 0-based, as in JSON).
"""
from __future__ import annotations

from dataclasses import dataclass


class DatasetError(Exception):
    """A dataset problem with an optional location.

    ``str(err)`` reads like ``row 17, field 'conversations[1].value': empty assistant turn``.

    Args:
        message: what is wrong, and where possible how to fix it.
        row: 1-based row number, or None when the problem concerns the whole file.
        field: column / JSON path inside the row, or None.
    """

    def __init__(self, message: str, row: int | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.row = row
        self.field = field

    def location(self) -> str:
        """``"row 3, field 'x'"``, ``"row 3"``, ``"field 'x'"`` or ``""``."""
        parts = []
        if self.row is not None:
            parts.append(f"row {self.row}")
        if self.field is not None:
            parts.append(f"field {self.field!r}")
        return ", ".join(parts)

    def __str__(self) -> str:
        loc = self.location()
        return f"{loc}: {self.message}" if loc else self.message

    def to_dict(self) -> dict:
        """JSON-serialisable form: ``{"row", "field", "message"}``."""
        return {"row": self.row, "field": self.field, "message": self.message}


@dataclass(frozen=True)
class RowIssue:
    """One invalid row (or a warning about a row) collected during validation.

    Attributes:
        row: 1-based row number.
        field: column / JSON path, or None when the whole row is affected.
        message: human-readable explanation.
    """

    row: int
    field: str | None
    message: str

    def __str__(self) -> str:
        return str(DatasetError(self.message, self.row, self.field))

    @classmethod
    def from_error(cls, err: DatasetError, row: int) -> "RowIssue":
        return cls(row=err.row if err.row is not None else row, field=err.field, message=err.message)
