"""Read dataset files into rows (plain dicts), streaming where practical.

Supported files (chosen by extension, JSON vs JSONL also sniffed from the content):

* ``.json``   — an array of objects; or one object that is itself a single example
  (``{"conversations": [...]}`` / ``{"messages": [...]}``); or one object holding the rows
  in a list under ``data``/``rows``/``examples``/``train``/``records``/``items``.
  An array of strings is read as ``{"text": s}`` rows.  A ``.json`` file that is really
  JSON Lines is read as JSON Lines.
* ``.jsonl`` / ``.ndjson`` — one object per line; blank lines are skipped (not rows).
* ``.csv`` / ``.tsv`` — first line is the header; empty header cells are named
  ``column_<n>`` (1-based) and dropped from a row where empty.  Rows are streamed.
* ``.parquet`` — streamed in record batches with pyarrow.
* ``.txt`` — plain text for continued pre-training, one ``{"text": ...}`` row per document:
  if the file contains ``<|endoftext|>`` documents are split on it; otherwise if it has
  blank lines, documents are the blank-line separated paragraphs; otherwise each line is a
  document (e.g. one Wikipedia article per line — lines of any length are fine).
  A ``.txt`` file whose content is JSON / JSON Lines objects is still read as text, but
  :func:`txt_json_hint` gives the report a warning suggesting ``.json``/``.jsonl``.

Row numbers are 1-based (see :mod:`app.data.errors`).  Whole-file problems (unreadable
file, invalid UTF-8, a JSON document that does not parse) raise :class:`DatasetError`;
problems confined to one row (a bad JSONL line, a ragged CSV row, a non-object row) are
yielded as a :class:`Record` whose ``error`` is set, so the caller can collect them.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import dataclass
from typing import Iterator

from .errors import DatasetError

TEXT_EXTENSIONS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                   ".tsv": "csv", ".parquet": "parquet", ".txt": "txt"}
SUPPORTED_EXTENSIONS = tuple(TEXT_EXTENSIONS)
ROW_LIST_KEYS = ("data", "rows", "examples", "train", "records", "items")
ENDOFTEXT = "<|endoftext|>"
_UTF8_HINT = ("the file is not valid UTF-8 (it looks like Latin-1/Windows-1252 or Mac-Roman); "
              "re-save it as UTF-8 and upload it again")


@dataclass
class Record:
    """One row of a file.

    Attributes:
        row: 1-based row number.
        data: the row as a dict, or None when ``error`` is set.
        error: the problem that made the row unreadable, or None.
        line: 1-based line of the file where the row starts (text formats), else None.
    """

    row: int
    data: dict | None
    error: DatasetError | None = None
    line: int | None = None


def file_kind(path: str | os.PathLike) -> str:
    """Return ``json``, ``jsonl``, ``csv``, ``parquet`` or ``txt`` for a path.

    Raises:
        DatasetError: unsupported extension.
    """
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in TEXT_EXTENSIONS:
        raise DatasetError(f"unsupported file type {ext or '(no extension)'!r}; "
                           f"use one of {', '.join(SUPPORTED_EXTENSIONS)}")
    return TEXT_EXTENSIONS[ext]


def _utf8_error(exc: UnicodeDecodeError, base_offset: int, line: int | None,
                row: int | None) -> DatasetError:
    bad = exc.object[exc.start:exc.start + 1]
    where = f"byte offset {base_offset + exc.start}"
    if line is not None:
        where += f" (line {line})"
    return DatasetError(f"invalid UTF-8 byte 0x{bad.hex()} at {where}: {_UTF8_HINT}", row=row)


def _decoded_lines(fh, on_error_row) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, decoded line with its line ending) from a binary file.

    ``on_error_row()`` gives the row number to name when a line is not UTF-8.
    """
    offset = 0
    for lineno, raw in enumerate(fh, start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw, offset = raw[3:], 3
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _utf8_error(exc, offset, lineno, on_error_row()) from None
        offset += len(raw)
        yield lineno, text


def _open(path) -> "object":
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DatasetError(f"cannot open the file: {exc.strerror or exc}") from None


def iter_records(path: str | os.PathLike, kind: str | None = None) -> Iterator[Record]:
    """Yield the rows of a dataset file as :class:`Record` objects, in file order.

    Args:
        path: the file.
        kind: override the file kind (``json``/``jsonl``/``csv``/``parquet``/``txt``).

    Raises:
        DatasetError: unsupported type, unreadable file, invalid UTF-8 (naming the row,
            line and byte offset), a JSON document that does not parse (line/column),
            an empty file, an invalid Parquet file.
    """
    kind = kind or file_kind(path)
    if not os.path.isfile(path):
        raise DatasetError("file not found")
    if kind != "parquet":
        _refuse_binary(path, kind)
    if kind in ("json", "jsonl"):
        yield from _iter_json(path, kind)
    elif kind == "csv":
        yield from _iter_csv(path, delimiter="\t" if str(path).lower().endswith(".tsv") else ",")
    elif kind == "parquet":
        yield from _iter_parquet(path)
    elif kind == "txt":
        yield from _iter_txt(path)
    else:
        raise DatasetError(f"unknown file kind {kind!r}")


#: Leading bytes of binary files people rename by mistake: (magic, what it is, what to do).
_MAGIC = ((b"PAR1", "a Parquet file", "rename it to .parquet"),
          (b"PK\x03\x04", "a zip archive", "unzip it and upload the dataset file inside"),
          (b"\x1f\x8b", "a gzip-compressed file", "decompress it first"))


def _refuse_binary(path, kind: str) -> None:
    """DatasetError naming the real format when a text-kind file starts with a binary magic."""
    with _open(path) as fh:
        head = fh.read(4)
    for magic, what, fix in _MAGIC:
        if head.startswith(magic):
            raise DatasetError(f"this is {what} (it starts with {magic!r}), not a {kind} file: "
                               f"{fix}")


def _first_char(path) -> str:
    with _open(path) as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1].decode("latin-1")


def _iter_json(path, kind: str) -> Iterator[Record]:
    first = _first_char(path)
    if first == "":
        raise DatasetError("the file is empty")
    if kind == "jsonl" and first != "[":
        yield from _iter_jsonl(path)
        return
    with _open(path) as fh:
        raw = fh.read()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise _utf8_error(exc, 0, line, None) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and first == "{":
            yield from _iter_jsonl(path)  # a .json file holding JSON Lines
            return
        raise DatasetError(f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    rows = _rows_of_document(doc)
    for i, item in enumerate(rows, start=1):
        yield _record_of(item, i)


def _rows_of_document(doc) -> list:
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict):
        if not any(k in doc for k in ("conversations", "messages", "conversation")):
            for key in ROW_LIST_KEYS:
                val = doc.get(key)
                if isinstance(val, list) and val and all(isinstance(v, dict) for v in val):
                    return val
        return [doc]
    raise DatasetError(f"the JSON document is a {type(doc).__name__}; expected an array of "
                       "objects or an object")


def _record_of(item, row: int, line: int | None = None) -> Record:
    if isinstance(item, dict):
        return Record(row, item, None, line)
    if isinstance(item, str):
        return Record(row, {"text": item}, None, line)
    return Record(row, None, DatasetError(
        f"row is a JSON {type(item).__name__}, expected an object", row=row), line)


def _iter_jsonl(path) -> Iterator[Record]:
    row = 0
    with _open(path) as fh:
        for lineno, line in _decoded_lines(fh, lambda: row + 1):
            if not line.strip():
                continue
            row += 1
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                yield Record(row, None, DatasetError(
                    f"invalid JSON on line {lineno}, column {exc.colno}: {exc.msg}", row=row), lineno)
                continue
            yield _record_of(item, row, lineno)


def _iter_csv(path, delimiter: str) -> Iterator[Record]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    state = {"row": 0}
    with _open(path) as fh:
        lines = _decoded_lines(fh, lambda: state["row"] + 1)
        line_of = {}

        def text_lines():
            for lineno, text in lines:
                line_of["last"] = lineno
                yield text

        reader = csv.reader(text_lines(), delimiter=delimiter)
        try:
            header = next(reader, None)
            if header is None:
                raise DatasetError("the file is empty")
            names = [h.strip() or f"column_{i + 1}" for i, h in enumerate(header)]
            unnamed = {n for h, n in zip(header, names) if not h.strip()}
            start_line = line_of.get("last", 1) + 1
            for fields in reader:
                end_line = line_of.get("last", start_line)
                if not fields or (len(fields) == 1 and not fields[0].strip()):
                    start_line = end_line + 1
                    continue
                state["row"] += 1
                row = state["row"]
                if len(fields) != len(names):
                    yield Record(row, None, DatasetError(
                        f"line {start_line} has {len(fields)} fields but the header has "
                        f"{len(names)} (an unquoted delimiter or quote in the text?)", row=row),
                        start_line)
                else:
                    data = {n: v for n, v in zip(names, fields) if not (n in unnamed and v == "")}
                    yield Record(row, data, None, start_line)
                start_line = end_line + 1
        except csv.Error as exc:
            raise DatasetError(f"malformed CSV near line {line_of.get('last', '?')}: {exc}",
                               row=state["row"] + 1) from None


def _iter_parquet(path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
        pf = pq.ParquetFile(path)
        batches = pf.iter_batches(batch_size=1024)
        row = 0
        for batch in batches:
            for item in batch.to_pylist():
                row += 1
                yield _record_of(item, row)
    except DatasetError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for corrupt files
        raise DatasetError(f"cannot read the Parquet file: {exc}") from None


def txt_split_mode(path: str | os.PathLike) -> str:
    """How a .txt file is split into documents: ``endoftext``, ``paragraph`` or ``line``."""
    has_blank, seen_text = False, False
    with _open(path) as fh:
        for raw in fh:
            if ENDOFTEXT.encode() in raw:
                return "endoftext"
            if raw.strip():
                seen_text = True
            elif seen_text:
                has_blank = True
    return "paragraph" if has_blank else "line"


def txt_json_hint(path: str | os.PathLike, sample: int = 20) -> str | None:
    """A warning when a ``.txt`` file really holds JSON or JSON Lines rows, else None.

    Such a file is still read as plain text (its JSON syntax becomes training text), since the
    extension says so; the warning names the extension that makes its fields count. A file is
    JSON-like when it starts with ``[`` or ``{`` and its first ``sample`` rows all parse as
    objects.
    """
    first = _first_char(path)
    if first not in ("[", "{"):
        return None
    rows = []
    try:
        for rec in _iter_json(path, "json"):
            if rec.error is not None or not isinstance(rec.data, dict):
                return None
            rows.append(rec.data)
            if len(rows) >= sample:
                break
    except DatasetError:
        return None
    if not rows:
        return None
    ext = ".json" if first == "[" else ".jsonl"
    keys = ", ".join(list(rows[0])[:6])
    return (f"this .txt file holds {'JSON' if ext == '.json' else 'JSON Lines'} rows (fields: {keys}) "
            f"but is read as plain text, JSON syntax and all; rename it to {ext} and upload it "
            f"again to train on its fields")


def _iter_txt(path) -> Iterator[Record]:
    mode = txt_split_mode(path)
    row = 0
    buf: list[str] = []
    buf_line = 1
    with _open(path) as fh:
        for lineno, line in _decoded_lines(fh, lambda: row + 1):
            if mode == "line":
                if line.strip():
                    row += 1
                    yield Record(row, {"text": line.rstrip("\r\n")}, None, lineno)
                continue
            if mode == "paragraph" and not line.strip():
                doc = "".join(buf).strip()
                if doc:
                    row += 1
                    yield Record(row, {"text": doc}, None, buf_line)
                buf, buf_line = [], lineno + 1
                continue
            if mode == "endoftext" and ENDOFTEXT in line:
                pieces = line.split(ENDOFTEXT)
                for piece in pieces[:-1]:
                    buf.append(piece)
                    doc = "".join(buf).strip()
                    if doc:
                        row += 1
                        yield Record(row, {"text": doc}, None, buf_line)
                    buf, buf_line = [], lineno
                buf.append(pieces[-1])
                continue
            if not buf:
                buf_line = lineno
            buf.append(line)
    doc = "".join(buf).strip()
    if doc:
        row += 1
        yield Record(row, {"text": doc}, None, buf_line)
    if row == 0:
        raise DatasetError("the text file holds no text")


def read_records(path: str | os.PathLike, limit: int | None = None) -> list[Record]:
    """The first ``limit`` records (all when None) as a list. Raises like :func:`iter_records`."""
    out = []
    for rec in iter_records(path):
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    return out


