"""A throwaway Postgres database for a test, on the server named by WHETSTONE_TEST_POSTGRES_URL."""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text

from app.store.db import reset_engines

PG_URL = os.environ.get("WHETSTONE_TEST_POSTGRES_URL", "")


@contextmanager
def throwaway_database() -> Iterator[str]:
    """Create an empty database, yield its SQLAlchemy URL, drop it afterwards (engines reset).
    Skips the test when WHETSTONE_TEST_POSTGRES_URL is not set (``make test`` sets it)."""
    if not PG_URL:
        pytest.skip("WHETSTONE_TEST_POSTGRES_URL is not set (make test sets it)")
    name = f"whetstone_{secrets.token_hex(6)}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield PG_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        reset_engines()
        with admin.connect() as c:
            c.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()
