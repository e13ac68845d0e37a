"""Faults the worker survives: a full disk, a locked database, a lease lost mid-step.

* :func:`describe` turns a disk-full or database-locked exception into the one-line cause a
  user reads on the job ("disk full: 0 bytes free in the data dir /data");
* :class:`Backoff` spaces retries (1 s doubling to 30 s) so a faulty store is not hammered;
* :func:`interrupt` raises an exception in another thread at its next Python instruction (how a
  handler stuck in a long training step stops within a second of losing its lease);
  :func:`clear_interrupt` withdraws one not yet raised.
"""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

from app.store.db import DISK_FULL, LOCKED, fault_of

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
