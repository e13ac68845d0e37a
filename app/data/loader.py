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
from dataclasses import dataclass
from typing import Iterator

from .errors import DatasetError

TEXT_EXTENSIONS = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv",
                   ".tsv": "csv", ".parquet": "parquet", ".txt": "txt"}
SUPPORTED_EXTENSIONS = tuple(TEXT_EXTENSIONS)
ROW_LIST_KEYS = ("data", "rows", "examples", "train", "records", "items")
ENDOFTEXT = "<|endoftext|>"
#: Bounds that keep a reader's memory small whatever the file holds (a row, a CSV field or a
#: line larger than this is refused by row number; a Parquet file is checked from its metadata
#: before any data is decompressed).
MAX_ROW_BYTES = 8 * 1024 * 1024
MAX_ROWS = 5_000_000
PARQUET_MAX_ROW_GROUP_BYTES = 512 * 1024 * 1024
PARQUET_MAX_TOTAL_BYTES = 8 * 1024 * 1024 * 1024
PARQUET_MAX_ROW_GROUPS = 100_000
PARQUET_MAX_COLUMNS = 1_000
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


class LineTooLong(Exception):
    """A line over :data:`MAX_ROW_BYTES` (its bytes were skipped, never held in memory)."""

    def __init__(self, lineno: int, size: int):
        super().__init__(lineno, size)
        self.lineno, self.size = lineno, size


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def too_large(what: str, size: int) -> str:
    """The message for a row or field over the size limit."""
    return (f"{what} is {_mib(size)}, over the limit of {_mib(MAX_ROW_BYTES)} per row; "
            "split it or leave it out")


def _bounded_lines(fh, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(1-based line number, raw line or None when longer than ``limit`` bytes, its size);
    an over-long line is skipped in chunks, so memory stays under ``limit``."""
    lineno = 0
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield lineno, raw, len(raw)
            continue
        size = len(raw)
        while raw and not raw.endswith(b"\n"):
            raw = fh.readline(1024 * 1024)
            size += len(raw)
        yield lineno, None, size


def _decoded_lines(fh, on_error_row, on_long=None) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, decoded line with its line ending) from a binary file.

    ``on_error_row()`` gives the row number to name when a line is not UTF-8. A line over
    :data:`MAX_ROW_BYTES` raises :class:`LineTooLong`, or, with ``on_long``, is reported
    through ``on_long(lineno, size)`` and skipped.
    """
    offset = 0
    for lineno, raw, size in _bounded_lines(fh, MAX_ROW_BYTES):
        if raw is None:
            offset += size
            if on_long is None:
                raise LineTooLong(lineno, size)
            on_long(lineno, size)
            continue
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
    try:
        yield from _iter_records(path, kind)
    except LineTooLong as exc:
        raise DatasetError(too_large(f"line {exc.lineno}", exc.size)) from None


def _iter_records(path, kind: str | None) -> Iterator[Record]:
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
    if os.path.getsize(path) <= MAX_ROW_BYTES:
        yield from _iter_small_json(path, first)
    elif first == "{" and _first_line_is_object(path):
        yield from _iter_jsonl(path)  # a large .json file holding JSON Lines
    else:
        yield from _iter_json_stream(path, first)


def _first_line_is_object(path) -> bool:
    """True when the first line of the file is a whole JSON object (JSON Lines in a .json)."""
    with _open(path) as fh:
        raw = fh.readline(MAX_ROW_BYTES + 1)
    try:
        return isinstance(json.loads(raw.decode("utf-8-sig")), dict)
    except (ValueError, RecursionError):
        return False


def _iter_small_json(path, first: str) -> Iterator[Record]:
    """A document of at most :data:`MAX_ROW_BYTES` read whole (an array, one example, rows
    under a key, or JSON Lines), so that a syntax error names its line and column."""
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
    except RecursionError:
        raise DatasetError("the JSON document is nested too deeply to be a dataset") from None
    rows = _rows_of_document(doc)
    for i, item in enumerate(rows, start=1):
        yield _record_of(item, i)


def _rows_key(path) -> str | None:
    """The first top-level key of a large ``{...}`` document whose value is an array of rows."""
    import ijson

    with _open(path) as fh:
        key = None
        for prefix, event, value in ijson.parse(fh):
            if prefix == "" and event == "map_key":
                key = value
            elif prefix == key and event == "start_array" and key in ROW_LIST_KEYS:
                return key
            elif prefix == "" and event == "end_map":
                return None
    return None


def _iter_json_stream(path, first: str) -> Iterator[Record]:
    """Rows of a JSON array (or of a large object's row list) read item by item with ijson,
    so memory holds one row at a time; a row spanning more than :data:`MAX_ROW_BYTES` of the
    file is refused by number."""
    import ijson

    prefix = "item"
    if first == "{":
        key = _rows_key(path)
        if key is None:
            raise DatasetError(f"the JSON object is larger than {_mib(MAX_ROW_BYTES)} and holds no "
                               f"list of rows under {', '.join(ROW_LIST_KEYS)}")
        prefix = f"{key}.item"
    elif first != "[":
        raise DatasetError("the JSON document is not an array of objects or an object")
    row = 0
    with _open(path) as fh:
        last = 0
        try:
            for item in ijson.items(fh, prefix, use_float=True):
                row += 1
                pos = fh.tell()
                if row > MAX_ROWS:
                    raise DatasetError(f"the file holds more than {MAX_ROWS:,} rows")
                size, last = pos - last, pos
                if size > MAX_ROW_BYTES + 2 * 65536 and not isinstance(item, (int, float, bool)):
                    yield Record(row, None, DatasetError(too_large(f"row {row}", size), row=row))
                    continue
                yield _record_of(item, row)
        except ijson.IncompleteJSONError as exc:
            msg = " ".join(str(exc).split())[:300]
            if "invalid utf-8" in msg.lower() or "utf-8" in msg.lower():
                raise DatasetError(f"the file is not valid UTF-8 near row {row + 1}: {_UTF8_HINT}",
                                   row=row + 1) from None
            raise DatasetError(f"invalid JSON after row {row}: {msg}", row=row + 1) from None
        except UnicodeDecodeError as exc:
            raise DatasetError(f"invalid UTF-8 near row {row + 1}: {_UTF8_HINT}", row=row + 1) \
                from None


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
    long_lines: list[tuple[int, int]] = []
    with _open(path) as fh:
        lines = _decoded_lines(fh, lambda: row + 1, lambda n, size: long_lines.append((n, size)))
        for lineno, line in lines:
            while long_lines:
                n, size = long_lines.pop(0)
                row += 1
                yield Record(row, None, DatasetError(too_large(f"line {n}", size), row=row), n)
            if not line.strip():
                continue
            row += 1
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                yield Record(row, None, DatasetError(
                    f"invalid JSON on line {lineno}, column {exc.colno}: {exc.msg}", row=row), lineno)
                continue
            except RecursionError:
                yield Record(row, None, DatasetError(
                    f"line {lineno} is nested too deeply to be a dataset row", row=row), lineno)
                continue
            yield _record_of(item, row, lineno)
        for n, size in long_lines:
            row += 1
            yield Record(row, None, DatasetError(too_large(f"line {n}", size), row=row), n)


def _iter_csv(path, delimiter: str) -> Iterator[Record]:
    csv.field_size_limit(MAX_ROW_BYTES)
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
            if "field larger than field limit" in str(exc):
                raise DatasetError(f"a field of row {state['row'] + 1} is over the limit of "
                                   f"{_mib(MAX_ROW_BYTES)} per row; split it or leave it out",
                                   row=state["row"] + 1) from None
            raise DatasetError(f"malformed CSV near line {line_of.get('last', '?')}: {exc}",
                               row=state["row"] + 1) from None


def check_parquet(pf) -> None:
    """Refuse a Parquet file whose metadata promises more than the reader may decompress
    (rows, row groups, columns, uncompressed bytes per row group and in all), before reading.

    Raises:
        DatasetError: naming the limit and the value the file declares.
    """
    md = pf.metadata
    checks = ((md.num_rows, MAX_ROWS, "rows"), (md.num_row_groups, PARQUET_MAX_ROW_GROUPS,
                                                  "row groups"),
              (md.num_columns, PARQUET_MAX_COLUMNS, "columns"))
    for value, limit, what in checks:
        if value > limit:
            raise DatasetError(f"the Parquet file declares {value:,} {what}; the limit is {limit:,}")
    total = 0
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        size = max(rg.total_byte_size, sum(rg.column(c).total_uncompressed_size
                                           for c in range(rg.num_columns)))
        total += size
        if size > PARQUET_MAX_ROW_GROUP_BYTES or total > PARQUET_MAX_TOTAL_BYTES:
            raise DatasetError(f"the Parquet file decompresses to more than "
                               f"{_mib(min(size, total))} (row group {i + 1}); the limits are "
                               f"{_mib(PARQUET_MAX_ROW_GROUP_BYTES)} per row group and "
                               f"{_mib(PARQUET_MAX_TOTAL_BYTES)} in all")
        if rg.num_rows and size / rg.num_rows > MAX_ROW_BYTES:
            raise DatasetError(too_large(f"an average row of row group {i + 1}",
                                         int(size / rg.num_rows)))


def _iter_parquet(path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
        pf = pq.ParquetFile(path)
        check_parquet(pf)
        batches = pf.iter_batches(batch_size=256)
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


