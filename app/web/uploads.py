"""Stream a multipart upload straight to disk, enforcing the size limit while it arrives.

The request body is parsed incrementally with python-multipart: file bytes go to a temporary
``*.part`` file under ``data_dir/uploads`` as they arrive; the limit (``settings.max_upload_mb``)
is checked on every chunk, and an oversize or interrupted upload (client gone, malformed body,
request cancelled) deletes its partial file. The caller renames the finished temp file to its
final name.

The event loop only receives the chunks: they are handed in batches of about
:data:`FEED_BATCH_BYTES` to a worker thread (``run_in_threadpool``), which runs the parser and
the file writes, so neither a slow disk nor the parser holds up other requests
(``tests/web/test_upload_bombs.py`` probes ``/healthz`` while 430 MiB stream in). At most one
batch waits while the previous one is written: an upload holds about two batches in memory.
"""
from __future__ import annotations

import asyncio
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.concurrency import run_in_threadpool


class UploadError(Exception):
    """A problem with the upload itself (not with its content); ``status`` is the HTTP code."""

    def __init__(self, message: str, status: int = 400, param: str | None = "file"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


@dataclass
class ReceivedUpload:
    """Result of :func:`receive_upload`: form fields and the temp file of the one file part."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    temp_path: Path | None = None
    bytes: int = 0

    def take(self) -> Path:
        """Hand the temp file over to the caller (who must move or delete it): its path."""
        path, self.temp_path = self.temp_path, None
        if path is None:
            raise UploadError("no file was received", 400)
        return path

    def discard(self) -> None:
        """Delete the temp file, if any."""
        if self.temp_path is not None:
            self.temp_path.unlink(missing_ok=True)
            self.temp_path = None


def browser_filename(raw: bytes) -> str:
    """A part's ``filename`` as the user named the file: browsers (and httpx) send ``"`` as
    ``%22`` and CR/LF as ``%0D``/``%0A`` (the HTML multipart/form-data encoding), so
    ``my "best" data.jsonl`` is not shown as ``my %22best%22 data.jsonl``."""
    name = raw.decode("utf-8", "replace")
    return name.replace("%22", '"').replace("%0D", "\r").replace("%0A", "\n")


#: Bytes of request body collected on the event loop before the thread parses and writes them.
FEED_BATCH_BYTES = 1024 * 1024


def limit_message(limit_mb: int) -> str:
    return (f"the file is larger than the upload limit of {limit_mb} MiB "
            f"(WHETSTONE_MAX_UPLOAD_MB); nothing was saved")


#: The parser's complaints about a too-large part header, in a user's words.
_HEADER_LIMITS = {"maximum header size exceeded":
                  "a part's headers are too long (is the file name thousands of characters "
                  "long? rename the file)",
                  "maximum header count exceeded": "a part has too many headers"}


def unreadable_message(failure: BaseException) -> str:
    """What a user reads when an upload's body could not be parsed or received: the
    multipart parser's error (``failure``: a python-multipart ``FormParserError``, whose text
    names parser internals such as "Found invalid character 13 in header at 13") worded as
    "the upload's form data is malformed: …"; any other failure (the client went away) as an
    upload that did not arrive whole. Never the exception's own text."""
    if isinstance(failure, FormParserError):
        what = _HEADER_LIMITS.get(str(failure).strip().lower(),
                                  "it is not valid multipart/form-data (a part's headers or "
                                  "boundary are broken)")
        return (f"the upload's form data is malformed: {what}; nothing was saved: send the "
                "file again as a browser or `curl -F file=@data.jsonl` does")
    return "the upload did not arrive whole (the connection ended); nothing was saved: send " \
        "the file again"


async def receive_upload(request: Request, upload_dir: Path, limit_mb: int,
                         file_field: str = "file") -> ReceivedUpload:
    """Parse a ``multipart/form-data`` body, writing the part named ``file_field`` to disk.

    Raises:
        UploadError: not multipart, no file part, empty file, a body cut short (no closing
            boundary), or larger than ``limit_mb`` (status 413). No partial file is left behind.
    """
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise UploadError("send the file as multipart/form-data", 400)
    limit = limit_mb * 1024 * 1024
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + 64 * 1024:
        raise UploadError(limit_message(limit_mb), 413)

    upload_dir.mkdir(parents=True, exist_ok=True)
    out = ReceivedUpload()
    state: dict = {"name": None, "filename": None, "headers": {}, "hname": b"", "hval": b"",
                   "buf": bytearray(), "fh": None, "too_big": False}

    def on_part_begin() -> None:
        state.update(name=None, filename=None, headers={}, buf=bytearray())

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["hname"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["hval"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["hname"].decode("latin-1").lower()] = state["hval"]
        state["hname"], state["hval"] = b"", b""

    def on_headers_finished() -> None:
        disp, opts = parse_options_header(state["headers"].get("content-disposition", b""))
        name = opts.get(b"name", b"").decode("utf-8", "replace")
        state["name"] = name
        if name == file_field and b"filename" in opts:
            state["filename"] = browser_filename(opts[b"filename"])
            if out.temp_path is None:
                out.filename = state["filename"]
                out.temp_path = upload_dir / f".upload-{secrets.token_hex(8)}.part"
                state["fh"] = open(out.temp_path, "wb")

    def on_part_data(data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if state["filename"] is not None and state["fh"] is not None:
            out.bytes += len(chunk)
            if out.bytes > limit:
                state["too_big"] = True
                return
            state["fh"].write(chunk)
        elif len(state["buf"]) < 64 * 1024:
            state["buf"] += chunk

    def on_part_end() -> None:
        if state["filename"] is not None and state["fh"] is not None:
            state["fh"].close()
            state["fh"] = None
        elif state["name"] and state["filename"] is None:
            out.fields[state["name"]] = bytes(state["buf"]).decode("utf-8", "replace")

    parser = MultipartParser(params[b"boundary"], {
        "on_part_begin": on_part_begin, "on_part_data": on_part_data, "on_part_end": on_part_end,
        "on_header_field": on_header_field, "on_header_value": on_header_value,
        "on_header_end": on_header_end, "on_headers_finished": on_headers_finished,
    })

    def feed(chunks: list[bytes], last: bool) -> None:
        """Parse and write one batch of body chunks (in a worker thread)."""
        for chunk in chunks:
            parser.write(chunk)
            if state["too_big"]:
                raise UploadError(limit_message(limit_mb), 413)
        if last:
            parser.finalize()
            if parser.state != MultipartState.END:  # the body ended before its closing boundary
                raise UploadError("the upload was cut short (the multipart body has no closing "
                                  "boundary); nothing was saved: send the file again", 400)

    pending: asyncio.Future | None = None  # the batch being parsed while the next arrives
    try:
        batch: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            if not chunk:
                continue
            batch.append(chunk)
            size += len(chunk)
            if size >= FEED_BATCH_BYTES:
                if pending is not None:
                    await pending
                pending = asyncio.ensure_future(run_in_threadpool(feed, batch, False))
                batch, size = [], 0
        if pending is not None:
            await pending
        pending = None
        await run_in_threadpool(feed, batch, True)
    except BaseException as exc:
        failure = exc
        if pending is not None:  # let the thread finish with the file before deleting it
            try:
                await asyncio.shield(asyncio.wait([pending]))
            except asyncio.CancelledError:
                pending.add_done_callback(lambda _: _abort(state, out))
                raise
            if not pending.cancelled() and pending.exception() is not None \
                    and isinstance(exc, Exception):
                failure = pending.exception()
        _abort(state, out)
        if isinstance(failure, UploadError):
            raise failure from None
        if not isinstance(failure, Exception):  # cancelled: the request is gone
            raise
        # malformed body or client gone: never leave a partial file
        raise UploadError(unreadable_message(failure), 400) from None
    if out.temp_path is None:
        raise UploadError(f"no file was sent (expected a file field named {file_field!r})", 400)
    if out.bytes == 0:
        out.discard()
        raise UploadError("the file is empty", 400)
    return out


def _abort(state: dict, out: ReceivedUpload) -> None:
    fh = state.get("fh")
    if fh is not None:
        fh.close()
        state["fh"] = None
    out.discard()
