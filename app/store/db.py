"""Engine and sessions for SQLite (WAL, busy timeout) or Postgres, from one URL.

SQLite notes: every connection runs in WAL mode with ``busy_timeout``; pysqlite's own
transaction handling is switched off so that SQLAlchemy's ``begin`` emits the BEGIN we choose.
A connection given the execution option ``immediate=True`` starts with ``BEGIN IMMEDIATE``,
taking the write lock up front (used by the queue's claim and the other state changes).

Faults: :func:`fault_of` names the two database failures that are not bugs (the database is
locked past the busy timeout; the disk is full) so that the worker can back off and the web can
answer 503/507 instead of crashing or answering 500.
"""
from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, create_engine

SQLITE_BUSY_TIMEOUT_MS = 30_000

#: :func:`fault_of` values.
LOCKED, DISK_FULL = "locked", "disk_full"

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def make_engine(url: str, busy_timeout_s: float | None = None) -> Engine:
    """Create an engine for ``url``; SQLite gets WAL, a busy timeout (``busy_timeout_s``
    seconds, default 30: how long a writer waits for another's write lock before
    ``database is locked``) and explicit BEGINs."""
    if url.startswith("sqlite"):
        busy_ms = SQLITE_BUSY_TIMEOUT_MS if busy_timeout_s is None else int(busy_timeout_s * 1000)
        engine = create_engine(url, connect_args={"check_same_thread": False,
                                                  "timeout": busy_ms / 1000})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={busy_ms}")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            immediate = conn.get_execution_options().get("immediate", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine
    return create_engine(url, pool_pre_ping=True)


def get_engine(url: str | None = None) -> Engine:
    """The process-wide engine for ``url`` (default: the settings' database URL), with the
    settings' ``sqlite_busy_timeout_seconds``."""
    from app.settings import get_settings

    settings = get_settings()
    if url is None:
        url = settings.resolved_database_url
    with _lock:
        if url not in _engines:
            _engines[url] = make_engine(url, getattr(settings, "sqlite_busy_timeout_seconds",
                                                     None))
        return _engines[url]


def reset_engines() -> None:
    """Dispose every cached engine (tests and worker shutdown)."""
    with _lock:
        for eng in _engines.values():
            eng.dispose()
        _engines.clear()


@contextmanager
def session_scope(engine: Engine, immediate: bool = False) -> Iterator[Session]:
    """A session committed on success and rolled back on error.

    Args:
        engine: from :func:`get_engine`.
        immediate: on SQLite, start the transaction with ``BEGIN IMMEDIATE`` (write lock first).
    """
    bind = engine.execution_options(immediate=True) if immediate else engine
    with Session(bind, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def is_sqlite(engine: Engine) -> bool:
    """True when ``engine`` talks to SQLite."""
    return engine.dialect.name == "sqlite"


def fault_of(exc: BaseException) -> str | None:
    """:data:`LOCKED` when ``exc`` (or what it wraps) says the database is locked or busy,
    :data:`DISK_FULL` when it says the disk (or quota) is full, else None.

    Recognises SQLAlchemy's wrapped DBAPI errors (SQLite ``database is locked`` /
    ``database or disk is full``, Postgres lock timeouts and ``DiskFull``) and ``OSError`` with
    ``errno`` ENOSPC or EDQUOT, anywhere in the ``__cause__``/``__context__`` chain.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return DISK_FULL
        orig = getattr(exc, "orig", None)
        text = f"{exc} {orig or ''} {type(orig).__name__ if orig is not None else ''}".lower()
        if "disk is full" in text or "diskfull" in text or "no space left" in text:
            return DISK_FULL
        if "database is locked" in text or "database is busy" in text \
                or "locknotavailable" in text or "lock timeout" in text:
            return LOCKED
        exc = exc.__cause__ or exc.__context__
    return None
