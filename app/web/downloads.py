"""Streamed downloads shared by the page routes and the JSON API (one response shape)."""
from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

from fastapi.responses import StreamingResponse


def attachment(filename: str) -> str:
    """A ``Content-Disposition`` value that saves the body as ``filename`` (RFC 6266:
    ``filename*`` in UTF-8 when the name is not plain ASCII)."""
    quoted = quote(filename)
    if quoted == filename:
        return f'attachment; filename="{filename}"'
    return f"attachment; filename*=utf-8''{quoted}"


def zip_stream(filename: str, chunks: Iterator[bytes]) -> StreamingResponse:
    """A zip sent as it is produced (``chunks``), saved as ``filename``; no Content-Length."""
    return StreamingResponse(chunks, media_type="application/zip",
                             headers={"Content-Disposition": attachment(filename)})
