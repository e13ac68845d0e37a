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


def upgrade(url: str | None = None) -> None:
    """Apply every migration up to ``head``; safe to call on every start (idempotent)."""
    if url is None:
        from app.settings import get_settings

        s = get_settings()
        s.ensure_dirs()
        url = s.resolved_database_url
    command.upgrade(alembic_config(url), "head")


if __name__ == "__main__":
    upgrade(sys.argv[1] if len(sys.argv) > 1 else None)
    print("database is at the newest migration")
