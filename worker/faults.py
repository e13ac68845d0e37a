"""Faults the worker survives: a full disk, a locked database, a lease lost mid-step.

* :func:`describe` turns a disk-full or database-locked exception into the one-line cause a
  user reads on the job ("disk full: 0 bytes free in the data dir /data");
* :class:`Backoff` spaces retries (1 s doubling to 30 s) so a faulty store is not hammered;
* :func:`retry_start` runs one step of a process's start (migrate, register, reap) again while
  the database is locked or the disk full, so a fault at start delays the start, never ends it;
* :func:`interrupt` raises an exception in another thread at its next Python instruction (how a
  handler stuck in a long training step stops within a second of losing its lease);
  :func:`clear_interrupt` withdraws one not yet raised.
"""
from __future__ import annotations

import ctypes
import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from app.store.db import DISK_FULL, LOCKED, fault_of

log = logging.getLogger("worker")
T = TypeVar("T")

#: Below this many free bytes in the data dir the worker claims no job (it waits, backing off).
MIN_FREE_BYTES = 1 << 20


def free_bytes(path: Path) -> int:
    """Free bytes (for an unprivileged user) on the filesystem of ``path``; -1 if unknown."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1


def describe(exc: BaseException, data_dir: Path, busy_timeout_s: float | None = None) -> str | None:
    """The cause of a fault in one line, or None when ``exc`` is not a disk/lock fault.

    Args:
        exc: any exception (SQLAlchemy errors and OSError are recognised, also when wrapped).
        data_dir: the data dir, whose free space the message quotes.
        busy_timeout_s: the database busy timeout (seconds), quoted for a lock.
    """
    fault = fault_of(exc)
    if fault == DISK_FULL:
        return f"disk full: {max(free_bytes(data_dir), 0)} bytes free in the data dir ({data_dir})"
    if fault == LOCKED:
        waited = f" for more than {busy_timeout_s:g} s" if busy_timeout_s else ""
        return f"the database was locked{waited} (another process held its write lock)"
    return None


class Backoff:
    """Delays for retries: ``first`` seconds, doubled after each failure up to ``most``."""

    def __init__(self, first: float = 1.0, most: float = 30.0):
        self.first, self.most = first, most
        self.next = first

    def delay(self) -> float:
        """The delay to wait now (seconds); the following one doubles."""
        d, self.next = self.next, min(self.next * 2, self.most)
        return d

    def reset(self) -> None:
        """After a success: the next failure waits ``first`` again."""
        self.next = self.first


class StartStopped(Exception):
    """Shutdown was asked for while :func:`retry_start` waited out a fault."""


def retry_start(what: str, step: Callable[[], T], data_dir: Path, stop: threading.Event,
                busy_timeout_s: float | None = None, backoff: Backoff | None = None) -> T:
    """Run ``step`` (one idempotent write of a process's start) until it returns.

    While it fails on a locked database or a full disk (:func:`describe` recognises it) the
    failure is logged on one line ("cannot start (register worker w-1: the database was
    locked ...); retrying in 1 s") and retried after :class:`Backoff`'s delay.

    Args:
        what: the step, as the log line names it.
        step: the callable; called again after each fault, so it must be safe to repeat.
        data_dir: the data dir (quoted for a full disk).
        stop: set by a shutdown signal; checked while waiting.
        busy_timeout_s: the database busy timeout (seconds), quoted for a lock.
        backoff: the delays (default 1 s doubling to 30 s).

    Returns: what ``step`` returned.

    Raises:
        StartStopped: ``stop`` was set while waiting out a fault.
        Exception: any other exception of ``step``, unchanged (a bad URL, a bug).
    """
    backoff = backoff or Backoff()
    while True:
        try:
            return step()
        except Exception as exc:
            cause = describe(exc, data_dir, busy_timeout_s)
            if cause is None:
                raise
            delay = backoff.delay()
            log.error("cannot start (%s: %s); retrying in %.0f s", what, cause, delay)
            if stop.wait(delay):
                raise StartStopped(f"stopped while waiting to {what}") from exc


def interrupt(thread_id: int, exc_type: type[BaseException]) -> bool:
    """Raise ``exc_type`` in the thread ``thread_id`` when it next runs Python code (CPython's
    ``PyThreadState_SetAsyncExc``; a thread inside one long C call raises when it returns).
    Returns whether that thread exists."""
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                                   ctypes.py_object(exc_type))
    return n == 1


def clear_interrupt(thread_id: int) -> None:
    """Withdraw an exception :func:`interrupt` sent that the thread has not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
