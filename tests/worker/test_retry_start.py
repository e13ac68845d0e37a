"""worker.faults.retry_start: a start step is repeated through a locked database or a full
disk, and only through those (the process-level behaviour is in test_faults.py)."""
from __future__ import annotations

import errno
import logging
import sqlite3
import threading

import pytest
from sqlalchemy.exc import OperationalError

from worker import faults


class _Fast(faults.Backoff):
    def __init__(self):
        super().__init__(0.01, 0.02)


def _locked() -> OperationalError:
    return OperationalError("BEGIN IMMEDIATE", {}, sqlite3.OperationalError("database is locked"))


def test_a_step_that_meets_faults_is_repeated_until_it_returns(tmp_path, caplog) -> None:
    raised = [_locked(), OSError(errno.ENOSPC, "No space left on device")]
    calls = []

    def step():
        calls.append(1)
        if raised:
            raise raised.pop(0)
        return "registered"

    with caplog.at_level(logging.ERROR, logger="worker"):
        got = faults.retry_start("register worker w-9", step, tmp_path, threading.Event(), 2.5,
                                 _Fast())
    assert got == "registered" and len(calls) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("cannot start (register worker w-9: the database was locked for more "
                        "than 2.5 s (another process held its write lock)); retrying in 0 s")
    assert lines[1].startswith("cannot start (register worker w-9: disk full: ")
    assert len(lines) == 2


def test_any_other_error_is_raised_at_once(tmp_path) -> None:
    calls = []

    def step():
        calls.append(1)
        raise ValueError("bad database URL")

    with pytest.raises(ValueError, match="bad database URL"):
        faults.retry_start("migrate the database", step, tmp_path, threading.Event())
    assert len(calls) == 1


def test_a_shutdown_while_waiting_stops_the_retries(tmp_path) -> None:
    stop = threading.Event()
    calls = []

    def step():
        calls.append(1)
        stop.set()  # the signal arrives during this attempt
        raise _locked()

    with pytest.raises(faults.StartStopped, match="while waiting to reap expired leases"):
        faults.retry_start("reap expired leases", step, tmp_path, stop)
    assert len(calls) == 1
