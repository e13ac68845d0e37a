"""Reaping under faults (issue 20): the grace and the lock wait a lease gets, the killed-worker
reason with its last memory, and how database/disk faults are recognised."""
from __future__ import annotations

import errno
import sqlite3
import threading
import time

import pytest
from sqlalchemy import text

from app.store import queue
from app.store.db import DISK_FULL, LOCKED, fault_of, make_engine, session_scope
from app.store.migrate import upgrade
from app.store.schema import JobState


@pytest.fixture
def url(tmp_path):
    u = f"sqlite:///{tmp_path / 'q.db'}"
    upgrade(u)
    return u


@pytest.fixture
def engine(url):
    e = make_engine(url)
    yield e
    e.dispose()


def test_grace_keeps_a_just_expired_lease(engine) -> None:
    job = queue.enqueue(engine, "train", {})
    queue.claim(engine, "w", 0.05)
    time.sleep(0.1)
    assert queue.reap(engine, grace=5) == []
    assert queue.reap(engine, grace=0) == [(job.id, JobState.QUEUED)]


def test_killed_worker_reason_quotes_its_last_memory(engine) -> None:
    job = queue.enqueue(engine, "train", {}, max_attempts=2)
    queue.claim(engine, "gpu0", 0.05)
    queue.record_memory(engine, job.id, 1.5, None)
    queue.record_memory(engine, job.id, 3.25, 20.5)
    time.sleep(0.1)
    assert queue.reap(engine, gone={"gpu0"}) == [(job.id, JobState.QUEUED)]
    queue.claim(engine, "gpu1", 0.05)
    time.sleep(0.1)
    assert queue.reap(engine) == [(job.id, JobState.FAILED)]
    j = queue.get_job(engine, job.id)
    assert j.error == ("lease of worker gpu1 expired (it stopped answering; last measured "
                       "memory 3.25 GiB RSS, 20.50 GiB GPU); failed after 2 attempts "
                       "(max_attempts=2)")


def test_time_spent_waiting_for_the_lock_is_given_back_to_leases(engine, url) -> None:
    dead = queue.enqueue(engine, "train", {})
    healthy = queue.enqueue(engine, "train", {})
    queue.claim(engine, "dead", 0.05)
    queue.claim(engine, "healthy", 0.6)  # expires while another process holds the lock
    time.sleep(0.1)
    holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None,
                             check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    threading.Timer(1.5, lambda: holder.execute("COMMIT")).start()
    t0 = time.monotonic()
    # waited 1.5 s: nobody could renew a lease then, so only the one dead before counts
    assert queue.reap(engine) == [(dead.id, JobState.QUEUED)]
    assert time.monotonic() - t0 >= 1.4
    assert queue.get_job(engine, healthy.id).state == JobState.RUNNING
    time.sleep(0.1)
    holder.close()
    assert queue.reap(engine) == [(healthy.id, JobState.QUEUED)]  # no wait: really expired


def test_fault_of_recognises_a_real_lock_and_a_full_disk(url) -> None:
    quick = make_engine(url, busy_timeout_s=0.2)
    holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(Exception) as got, session_scope(quick, immediate=True) as s:
            s.execute(text("SELECT 1"))
        assert fault_of(got.value) == LOCKED
    finally:
        holder.execute("COMMIT")
        holder.close()
        quick.dispose()
    try:
        raise RuntimeError("saving failed") from OSError(errno.ENOSPC, "No space left on device")
    except RuntimeError as e:
        assert fault_of(e) == DISK_FULL
    assert fault_of(ValueError("database")) is None
