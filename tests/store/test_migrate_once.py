"""The migration runs once at start: the first of ``make migrate``, the web and the workers to
come migrates; the others see the database at head and do nothing (issue 19, Low: it ran three
times)."""
from __future__ import annotations

import logging

import pytest

from app.store.migrate import at_head, upgrade
from tests.store.pgdb import throwaway_database


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_only_the_first_start_migrates(backend, tmp_path, caplog):
    if backend == "sqlite":
        ctx = None
        url = f"sqlite:///{tmp_path / 'once.db'}"
    else:
        ctx = throwaway_database()
        url = ctx.__enter__()
    try:
        assert not at_head(url)
        assert upgrade(url) is True and at_head(url)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="alembic"):
            assert [upgrade(url), upgrade(url)] == [False, False]
        assert not [r for r in caplog.records if "Running upgrade" in r.getMessage()]
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
