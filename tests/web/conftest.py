"""Fixtures: the web app on a temporary data dir with a real SQLite database (no worker)."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from app.store.db import reset_engines

from tests.conftest import SHARED_DATA as SHARED


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", seed_dir=SHARED if SHARED.is_dir() else None,
                    max_upload_mb=8)


@pytest.fixture
def app(settings):
    from app.web.main import create_app

    yield create_app(settings)
    reset_engines()


@pytest.fixture
def client(app):
    with TestClient(app) as c:
        yield c


@pytest.fixture
def engine(app, client):
    return app.state.engine


@pytest.fixture
def server(app):
    """The app served by a real uvicorn on a free loopback port; yields its base URL."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(timeout=10)
