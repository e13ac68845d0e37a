"""Batched job events: metric/log/progress rows written at most a few times per second.

Event shapes are those documented in :mod:`app.store.events`. Writes are buffered and flushed
when ``min_interval`` seconds have passed since the last write, when :meth:`Reporter.flush` is
called (the lease thread does so every heartbeat) and at the end of a job. Once the lease is
lost the reporter is disabled and drops everything (the job no longer belongs to us).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from sqlalchemy.engine import Engine

from app.store import events

log = logging.getLogger("worker.progress")


def rounded(value: Any, digits: int = 4) -> str:
    """A number for a log line: ``digits`` significant digits (``17.14``, ``-0.03333``), ``n/a``
    for None, the text of anything else."""
    if value is None:
        return "n/a"
    try:
        return f"{float(value):.{digits}g}"
    except (TypeError, ValueError):
        return str(value)


def _clean(v: Any) -> Any:
    """JSON-safe numbers: NaN/inf become None, numpy/torch scalars become floats."""
    if isinstance(v, bool) or v is None or isinstance(v, (str, int)):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return None if math.isnan(f) or math.isinf(f) else f


class Reporter:
    """Buffers events for one job and writes them in batches (thread-safe)."""

    def __init__(self, engine: Engine, job_id: int, min_interval: float = 0.5):
        self.engine = engine
        self.job_id = job_id
        self.min_interval = min_interval
        self._buf: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._last_flush = 0.0
        self._enabled = True
        self.written = 0

    def _add(self, type_: str, data: dict[str, Any], urgent: bool = False) -> None:
        with self._lock:
            if not self._enabled:
                return
            if type_ == "progress" and self._buf and self._buf[-1][0] == "progress" \
                    and self._buf[-1][1].get("stage") == data.get("stage"):
                self._buf[-1] = (type_, data)  # keep only the newest progress of a stage
            else:
                self._buf.append((type_, data))
        if urgent or time.monotonic() - self._last_flush >= self.min_interval:
            self.flush()

    def metric(self, **data: Any) -> None:
        """A metric event; ``step`` is required (see app.store.events)."""
        if "step" not in data:
            raise ValueError("metric events need a step")
        self._add("metric", {k: _clean(v) for k, v in data.items() if v is not None})

    def log(self, message: str, level: str = "info", **extra: Any) -> None:
        """A log line shown on the run page (``level`` info | warning | error)."""
        getattr(log, "warning" if level == "warning" else level if level in ("info", "error")
                else "info")("job %s: %s", self.job_id, message)
        self._add("log", {"level": level, "message": message, **extra}, urgent=level == "error")

    def sample(self, **data: Any) -> None:
        """A table of recent sample completions with their rewards (GRPO)."""
        self._add("sample", {k: v for k, v in data.items() if v is not None})

    def progress(self, stage: str, done: float, total: float, message: str | None = None) -> None:
        """Progress of a stage (download, convert, tokenize, save, ...)."""
        data: dict[str, Any] = {"stage": stage, "done": done, "total": total}
        if message:
            data["message"] = message
        self._add("progress", data)

    def flush(self) -> None:
        """Write everything buffered in one transaction."""
        with self._lock:
            items, self._buf = self._buf, []
            self._last_flush = time.monotonic()
            if not items or not self._enabled:
                return
            try:
                self.written += events.append_many(self.engine, self.job_id, items)
            except Exception:  # noqa: BLE001 - a metrics hiccup must never kill training
                log.exception("job %s: could not write %d events", self.job_id, len(items))

    def disable(self) -> None:
        """Drop buffered and future events (lease lost)."""
        with self._lock:
            self._enabled = False
            self._buf.clear()
