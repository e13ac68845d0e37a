"""Engine and sessions for SQLite (WAL, busy timeout) or Postgres, from one URL.

SQLite notes: every connection runs in WAL mode with ``busy_timeout``; pysqlite's own
transaction handling is switched off so that SQLAlchemy's ``begin`` emits the BEGIN we choose.
A connection given the execution option ``immediate=True`` starts with ``BEGIN IMMEDIATE``,
taking the write lock up front (used by the queue's claim and the other state changes).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, create_engine

SQLITE_BUSY_TIMEOUT_MS = 30_000

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def make_engine(url: str) -> Engine:
    """Create an engine for ``url``; SQLite gets WAL, a 30 s busy timeout and explicit BEGINs."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):  # noqa: ANN001
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
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
    """The process-wide engine for ``url`` (default: the settings' database URL)."""
    if url is None:
        from app.settings import get_settings

        url = get_settings().resolved_database_url
    with _lock:
        if url not in _engines:
            _engines[url] = make_engine(url)
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
