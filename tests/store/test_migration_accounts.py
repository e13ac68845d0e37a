"""Migration 0002 on a single-user data dir built at revision 0001: nothing is lost, the demo model
becomes shared, and the first admin owns every object that had no owner."""
from __future__ import annotations

from contextlib import nullcontext

import pytest
from alembic import command
from sqlalchemy import inspect, text

from app.store.db import get_engine, reset_engines, session_scope
from app.store.migrate import alembic_config
from app.studio import accounts, first_start
from tests.store.pgdb import throwaway_database

ROWS_0001 = [
    "INSERT INTO datasets (id, filename, path, bytes, purpose, status, created_at) VALUES "
    "('file-a', 'a.jsonl', '/d/a.jsonl', 10, 'fine-tune', 'processed', 1.0), "
    "('file-b', 'b.csv', '/d/b.csv', 20, 'fine-tune', 'processed', 2.0)",
    "INSERT INTO models (id, name, source, source_ref, status, created_at) VALUES "
    "('model-demo', 'stories260K', 'llama2c', 'x.bin|tok.bin', 'ready', 1.0), "
    "('model-mine', 'my-qwen', 'hf', 'Qwen/Qwen2.5-0.5B', 'ready', 2.0)",
    "INSERT INTO runs (id, kind, model_id, dataset_id, spec, job_id, created_at) VALUES "
    "('ftjob-1', 'sft', 'model-demo', 'file-a', '{\"spec_version\": 1}', 1, 3.0)",
    "INSERT INTO jobs (id, kind, payload, state, priority, attempts, max_attempts, "
    "cancel_requested, run_id, created_at) VALUES "
    "(1, 'train', '{\"run_id\": \"ftjob-1\"}', 'succeeded', 0, 1, 3, FALSE, 'ftjob-1', 3.0), "
    "(2, 'import_model', '{\"model_id\": \"model-mine\"}', 'succeeded', 10, 1, 3, FALSE, NULL, "
    "2.0)",
]


@pytest.fixture(params=["sqlite", "postgres"])
def old_db(request, tmp_path):
    """A database at revision 0001 with a single user's datasets, models, runs and jobs."""
    sqlite = request.param == "sqlite"
    with nullcontext(f"sqlite:///{tmp_path / 'whetstone.db'}") if sqlite \
            else throwaway_database() as url:
        command.upgrade(alembic_config(url), "0001")
        engine = get_engine(url)
        with session_scope(engine) as s:
            for sql in ROWS_0001:
                s.execute(text(sql))
        yield url, engine
        reset_engines()


def _owners(engine, table: str) -> dict[str, str | None]:
    with session_scope(engine) as s:
        return {str(r[0]): r[1] for r in s.execute(text(f"SELECT id, owner FROM {table}"))}


def test_0002_keeps_everything_and_the_first_admin_claims_it(old_db):
    url, engine = old_db
    command.upgrade(alembic_config(url), "head")
    with session_scope(engine) as s:
        shared = dict(s.execute(text("SELECT name, shared FROM models")).all())
        assert s.execute(text("SELECT count(*) FROM users")).scalar() == 0
    assert shared == {"stories260K": True, "my-qwen": False}
    assert set(_owners(engine, "datasets").values()) == {None}

    admin = first_start.complete_setup(engine, first_start.setup_token(engine), "root", "root-password")
    assert admin.role == "admin" and admin.id.startswith("user-")
    assert _owners(engine, "datasets") == {"file-a": admin.id, "file-b": admin.id}
    assert _owners(engine, "runs") == {"ftjob-1": admin.id}
    assert _owners(engine, "jobs") == {"1": admin.id, "2": admin.id}
    assert _owners(engine, "models") == {"model-demo": None, "model-mine": admin.id}

    member = accounts.create_user(engine, "alice", "alice-password", actor=admin)
    assert accounts.can_see(admin, member.id) and not accounts.can_see(member, admin.id)
    assert first_start.claim_unowned(engine, member.id) == {"datasets": 0, "runs": 0, "jobs": 0,
                                                         "models": 0}
    assert _owners(engine, "runs") == {"ftjob-1": admin.id}


def test_admin_password_on_an_old_data_dir_claims_too(old_db):
    url, engine = old_db
    command.upgrade(alembic_config(url), "head")
    admin = first_start.ensure_admin(engine, "admin", "docker-password")
    assert _owners(engine, "datasets") == {"file-a": admin.id, "file-b": admin.id}
    again = first_start.ensure_admin(engine, "admin", "new-docker-password")  # reset, same user
    assert again.id == admin.id
    assert accounts.authenticate(engine, "admin", "new-docker-password").id == admin.id


def test_0002_downgrades_and_upgrades_again(old_db):
    url, engine = old_db
    cfg = alembic_config(url)
    command.upgrade(cfg, "0002")
    command.downgrade(cfg, "0001")
    cols = [c["name"] for c in inspect(engine).get_columns("models")]
    assert "shared" not in cols and "owner" not in cols
    with session_scope(engine) as s:
        assert s.execute(text("SELECT count(*) FROM models")).scalar() == 2
    command.upgrade(cfg, "0002")
    with session_scope(engine) as s:
        demo = s.execute(text("SELECT shared FROM models WHERE name = 'stories260K'")).scalar()
        assert demo == True  # noqa: E712 (1 on SQLite)
