"""Alembic environment: migrates the database named by Whetstone's settings."""
from alembic import context
from sqlmodel import SQLModel

import app.store.schema  # noqa: F401  (registers the tables on SQLModel.metadata)
from app.store.db import get_engine

target_metadata = SQLModel.metadata


def run_migrations_online() -> None:
    url = context.config.attributes.get("url")
    engine = get_engine(url)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
