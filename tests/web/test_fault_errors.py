"""Writes during a database lock answer 503 "busy, retry" (OpenAI's error shape under /v1), a
full disk 507, never a 500 with a traceback (issue 20, item 7). The lock is a real SQLite write
lock held by another connection; the full disk is the ENOSPC a write raises."""
from __future__ import annotations

import errno
import sqlite3

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text

from app.store.db import make_engine, session_scope
from app.store.migrate import upgrade
from app.web.errors import install


def _app(url: str) -> FastAPI:
    engine = make_engine(url, busy_timeout_s=0.2)
    app = FastAPI()
    install(app)

    def write():
        with session_scope(engine, immediate=True) as s:
            s.execute(text("UPDATE jobs SET priority = priority WHERE id = 0"))
        return {"ok": True}

    def save():
        raise OSError(errno.ENOSPC, "No space left on device")

    for prefix in ("/v1", "/api"):
        app.post(f"{prefix}/write")(write)
        app.post(f"{prefix}/save")(save)
    return app


def test_locked_database_is_503_busy_retry_and_full_disk_is_507(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    client = TestClient(_app(url), raise_server_exceptions=False)
    assert client.post("/v1/write").json() == {"ok": True}
    holder = sqlite3.connect(str(tmp_path / "w.db"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        r = client.post("/v1/write")
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "busy_retry"
        assert err["message"].startswith("The studio is busy") and "retry" in err["message"]
        r = client.post("/api/write")
        assert r.status_code == 503 and r.json()["error"]["code"] == "busy_retry"
    finally:
        holder.execute("COMMIT")
        holder.close()
    assert client.post("/api/write").status_code == 200
    r = client.post("/v1/save")
    assert r.status_code == 507
    assert r.json()["error"]["code"] == "disk_full" and "disk is full" in r.json()["error"]["message"]
    assert client.post("/api/save").status_code == 507
