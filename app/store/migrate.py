"""Bring a database to the newest schema with Alembic (``python -m app.store.migrate``)."""
from __future__ import annotations

import sys
from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config for ``url`` (default: the settings' database URL)."""
    cfg = Config(str(MIGRATIONS / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["url"] = url
    return cfg


def at_head(url: str) -> bool:
    """Whether the database at ``url`` is already at the newest migration (a read, no lock)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine

    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision() == head
    except Exception:  # noqa: BLE001 - unreachable or new: let upgrade() say why
        return False
    finally:
        engine.dispose()


def upgrade(url: str | None = None) -> bool:
    """Apply every migration up to ``head``; safe to call on every start. The web, each worker
    and ``make migrate`` all call it: only the first finds work to do (the rest see the
    database at head and return at once). Returns whether migrations ran."""
    if url is None:
        from app.settings import get_settings

        s = get_settings()
        s.ensure_dirs()
        url = s.resolved_database_url
    if at_head(url):
        return False
    command.upgrade(alembic_config(url), "head")
    return True


if __name__ == "__main__":
    upgrade(sys.argv[1] if len(sys.argv) > 1 else None)
    print("database is at the newest migration")
