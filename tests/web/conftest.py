"""Fixtures: the web app on a temporary data dir with a real SQLite database (no worker).

The app has an admin (``ADMIN_USER``/``ADMIN_PASSWORD``, as ``WHETSTONE_ADMIN_PASSWORD`` creates
it); ``client`` is signed in as that admin with an access token (Bearer, so no CSRF token is
needed), on ``http://127.0.0.1`` (an allowed Host)."""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from app.store.db import reset_engines

from tests.conftest import SHARED_DATA as SHARED


ADMIN_USER = "admin"
ADMIN_PASSWORD = "admin-password-1"
BASE_URL = "http://127.0.0.1"


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data", seed_dir=SHARED if SHARED.is_dir() else None,
                    max_upload_mb=8, admin_user=ADMIN_USER, admin_password=ADMIN_PASSWORD)


def login_form_token(c: TestClient, path: str = "/login") -> str:
    """The pre-session CSRF token of the sign-in form at ``path`` (a GET, as a browser does;
    ``c`` keeps the token's cookie), for the form's ``csrf_token`` field."""
    import re

    page = c.get(path)
    assert page.status_code == 200, page.text
    return re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)


def signed_in(app, name: str = ADMIN_USER, password: str = ADMIN_PASSWORD, **kw) -> TestClient:
    """A TestClient for ``app`` (not yet started: use it in ``with``) that signs in as ``name``
    once started and sends its access token as ``Authorization: Bearer``."""

    class _Client(TestClient):
        def __enter__(self):
            c = super().__enter__()
            r = c.post("/api/login/access-token", data={"username": name, "password": password})
            assert r.status_code == 200, r.text
            c.headers["Authorization"] = f"Bearer {r.json()['access_token']}"
            return c

    return _Client(app, base_url=BASE_URL, **kw)


@pytest.fixture
def app(settings):
    from app.web.main import create_app

    yield create_app(settings)
    reset_engines()


@pytest.fixture
def make_client(tmp_path):
    """``make_client(**settings)`` -> a started TestClient of a new app on ``http://localhost``
    (data dir ``tmp_path/data`` unless given); all are stopped after the test."""
    from app.web.main import create_app

    opened = []

    def make(**kw) -> TestClient:
        kw.setdefault("data_dir", tmp_path / "data")
        c = TestClient(create_app(Settings(**kw)), base_url="http://localhost")
        c.__enter__()
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.__exit__(None, None, None)
    reset_engines()


@pytest.fixture
def client(app):
    with signed_in(app) as c:
        yield c


@pytest.fixture
def engine(app, client):
    return app.state.engine


@contextlib.contextmanager
def served(app):
    """The app served by a real uvicorn on a free loopback port (a thread); yields its base URL
    and stops the server afterwards."""
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


@pytest.fixture
def server(app):
    """The app served by a real uvicorn on a free loopback port; yields its base URL."""
    with served(app) as url:
        yield url


@pytest.fixture
def admin_key(app, server) -> str:
    """An API key of the admin on the running ``server`` (for the ``openai`` client)."""
    from app.studio import accounts

    admin = accounts.authenticate(app.state.engine, ADMIN_USER, ADMIN_PASSWORD)
    return accounts.create_api_key(app.state.engine, admin, "tests")[1]


def run_validations(app) -> int:
    """Run every queued ``validate_dataset`` job in this process through the real job function
    (worker.jobs.validate_dataset.run), ending each as the worker loop would; returns how many.
    Web tests have no worker process: an upload stays ``validating`` until this runs."""
    from app.store import queue
    from worker.context import JobContext
    from worker.jobs import validate_dataset
    from worker.progress import Reporter

    engine, settings, n = app.state.engine, app.state.settings, 0
    while (job := queue.claim(engine, "tests-inline", 60, ["validate_dataset"])) is not None:
        ctx = JobContext(engine, settings, job, "tests-inline", Reporter(engine, job.id))
        try:
            result = validate_dataset.run(ctx)
        except Exception as exc:  # noqa: BLE001 - recorded like the worker loop does
            ctx.reporter.flush()
            queue.fail(engine, job.id, "tests-inline", str(exc))
        else:
            ctx.reporter.flush()
            queue.finish(engine, job.id, "tests-inline", result)
        n += 1
    return n


def upload_and_import(client, worker, path) -> str:
    """Upload ``path`` through ``/v1/files`` (purpose fine-tune), validate it, and let
    ``worker`` (a started :class:`worker.loop.Worker`) import the demo model stories260K; returns
    the file id."""
    from app.store import repo

    with open(path, "rb") as fh:
        r = client.post("/v1/files", files={"file": (os.path.basename(path), fh)},
                        data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    run_validations(client.app)
    for _ in range(5):
        if repo.get_model(worker.engine, "stories260K").status == "ready":
            break
        worker.serve(once=True)
    assert repo.get_model(worker.engine, "stories260K").status == "ready"
    return r.json()["id"]


def upload_sft(client, name: str = "identity_alpaca.json") -> str:
    """Upload ../shared/data/sft/``name`` through the Datasets page as ``client``, run its
    background validation, and return the dataset id."""
    path = SHARED / "sft" / name
    r = client.post("/datasets", files={"file": (path.name, path.read_bytes())},
                    follow_redirects=False)
    assert r.status_code == 303, r.text
    run_validations(client.app)
    return r.headers["location"].rsplit("/", 1)[1]
