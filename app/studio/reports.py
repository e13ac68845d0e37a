"""Bridge from the web to the dataset layer (``app.data``): run its validation report.

:func:`app.data.report.inspect_dataset` does the work (format detection, validation with row
numbers, token-length histogram, preview segments with trained flags). This module picks the
tokenizer (a ready model's folder; before any model is ready, the GPT-2 BPE files of the seed
dir), calls it, and turns the result into the plain JSON dict that the templates, the JSON API
and the ``datasets.report`` column share. Whole-file problems raise
:class:`app.data.errors.DatasetError`.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from app.data.chat_template import DEFAULT_TEMPLATES
from app.data.encode import TokenizerBundle, byte_level_bpe, load_tokenizer_bundle
from app.data.errors import DatasetError
from app.data.report import inspect_dataset

PREVIEW_ROWS = 5
MAX_ISSUES = 200

_cache: dict[str, tuple[float, TokenizerBundle]] = {}
_lock = threading.Lock()


def default_templates() -> dict[str, str]:
    """Built-in chat templates offered when a model has none: ``{name: jinja}``."""
    return dict(DEFAULT_TEMPLATES)


def load_bundle(source: str) -> TokenizerBundle:
    """A tokenizer bundle from a HF model folder or a GPT-2 BPE folder (cached per folder)."""
    mtime = os.path.getmtime(source)
    with _lock:
        hit = _cache.get(source)
        if hit and hit[0] == mtime:
            return hit[1]
    vocab, merges = os.path.join(source, "gpt2_vocab.json"), os.path.join(source, "gpt2_merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):
        bundle = TokenizerBundle(byte_level_bpe(vocab, merges), None, "", "<|endoftext|>",
                                 {"eos_token": "<|endoftext|>"})
    else:
        bundle = load_tokenizer_bundle(source)
    with _lock:
        _cache[source] = (mtime, bundle)
    return bundle


def fallback_tokenizer_dir(seed_dir: Path | None) -> str | None:
    """GPT-2 BPE files under ``seed_dir/tokenizers/gpt2-bpe``, used before a model is ready."""
    if seed_dir is None:
        return None
    d = Path(seed_dir) / "tokenizers" / "gpt2-bpe"
    return str(d) if (d / "gpt2_vocab.json").is_file() else None


def inspect_file(path: str | Path, *, tokenizer_dir: str | None, chat_template: str | None = None,
                 max_seq_length: int = 1024, dataset_format: str | None = None,
                 train_on_responses_only: bool = True, on_rows=None,
                 column_mapping: dict[str, str] | None = None) -> dict[str, Any]:
    """The validation report of a dataset file as a JSON dict (``column_mapping``: the file's
    columns read as alpaca fields, see :func:`app.data.report.iter_rows`).

    Without any tokenizer the rows are still read, detected and validated (no token counts).
    ``on_rows(n)`` is called with the rows read so far, every few hundred rows (it may raise
    to stop the work).

    Raises:
        DatasetError: a whole-file problem (unreadable, not UTF-8, no valid row, ...).
    """
    if tokenizer_dir is None:
        return _untokenized_report(Path(path), max_seq_length, dataset_format, on_rows,
                                   column_mapping)
    report = inspect_dataset(str(path), load_bundle(tokenizer_dir), chat_template=chat_template,
                             max_seq_length=max_seq_length, fmt=dataset_format,
                             train_on_responses_only=train_on_responses_only,
                             preview_rows=PREVIEW_ROWS, max_issues=MAX_ISSUES, on_rows=on_rows,
                             column_mapping=column_mapping)
    data = report.model_dump(mode="json")
    data["tokenized"] = True
    if column_mapping:
        data["column_mapping"] = column_mapping
    return normalize_report(data, max_seq_length)


def normalize_report(r: dict[str, Any], max_seq_length: int) -> dict[str, Any]:
    """The keys the templates use: rows, valid_rows, invalid (list), histogram, preview dicts."""
    r = dict(r)
    r.setdefault("max_seq_length", max_seq_length)
    r["rows"] = r.get("total_rows", r.get("rows"))
    r["invalid"] = [{"row": i.get("row"), "field": i.get("field"), "message": i.get("message")}
                    for i in (r.get("errors") or r.get("invalid") or [])]
    r.setdefault("invalid_rows", len(r["invalid"]))
    r["warnings"] = [{"row": i.get("row"), "field": i.get("field"), "message": i.get("message")}
                     for i in (r.get("warnings") or [])]
    preview = []
    for p in r.get("preview") or []:
        segs = [{"text": s[0], "trained": bool(s[1])} if isinstance(s, (list, tuple)) else s
                for s in p.get("segments", [])]
        preview.append({**p, "segments": segs,
                        "truncation_note": truncation_note(p, r["max_seq_length"])})
    r["preview"] = preview
    return r


def truncation_note(row: dict[str, Any], max_seq_length: int | None) -> str | None:
    """What a preview row cut at ``max_seq_length`` says at its end, e.g. ``"… (truncated: 1252
    tokens, max_seq_length 512)"`` (its length before the cut); None for a row that fits."""
    n = row.get("num_tokens")
    if not isinstance(n, int) or not isinstance(max_seq_length, int) or n <= max_seq_length:
        return None
    return f"… (truncated: {n:,} tokens, max_seq_length {max_seq_length:,})"


def _untokenized_report(path: Path, max_seq_length: int, dataset_format: str | None,
                        on_rows=None, column_mapping: dict[str, str] | None = None
                        ) -> dict[str, Any]:
    from app.data import formats, loader
    from app.data.report import counted

    records = list(counted(loader.iter_records(path), on_rows))
    good = [rec for rec in records if rec.error is None and rec.data is not None]
    invalid = [rec.error.to_dict() for rec in records if rec.error is not None]
    if not good:
        first = invalid[0] if invalid else {}
        raise DatasetError(first.get("message", "the file holds no rows"), first.get("row"),
                           first.get("field"))
    mapping = formats.check_column_mapping(column_mapping)
    fmt = "alpaca" if mapping else formats.canonical_format(dataset_format) if dataset_format \
        else formats.detect_format([rec.data for rec in good[:100]])
    valid, preview = 0, []
    for rec in good:
        try:
            formats.normalize_row(formats.apply_column_mapping(rec.data, mapping) if mapping
                                  else rec.data, fmt, rec.row)
        except DatasetError as err:
            field = (mapping or {}).get(err.field, err.field)
            invalid.append({"row": err.row or rec.row, "field": field, "message": err.message})
            continue
        valid += 1
    if valid == 0:
        first = invalid[0]
        raise DatasetError(first["message"], first["row"], first["field"])
    invalid.sort(key=lambda i: i.get("row") or 0)
    hint = loader.txt_json_hint(path) if loader.file_kind(path) == "txt" else None
    return normalize_report({"format": fmt, "total_rows": len(records), "valid_rows": valid,
                             "invalid_rows": len(invalid), "errors": invalid[:MAX_ISSUES],
                             "warnings": [{"row": None, "field": None, "message": hint}] if hint else [],
                             "preview": preview, "tokenized": False, "histogram": [],
                             **({"column_mapping": mapping} if mapping else {})},
                            max_seq_length)
