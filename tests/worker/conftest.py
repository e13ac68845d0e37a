"""Worker tests use the shared fixtures of tests/conftest.py (shared_data, stories_hf) and
:func:`inline_studio`: the web app (signed in as the admin) and a worker loop in this process."""
from __future__ import annotations

import contextlib
from pathlib import Path

from app.settings import Settings
from app.store import repo
from app.store.db import reset_engines
from tests.conftest import SHARED_DATA
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, run_validations, signed_in


@contextlib.contextmanager
def inline_studio(data_dir: Path, uploads: list[Path], worker_id: str, **settings):
    """The app on ``data_dir`` with an in-process :class:`worker.loop.Worker` (not serving: call
    ``worker.serve(once=True)`` to run the next job), each of ``uploads`` uploaded through
    ``/v1/files`` and validated, and the demo model imported. Yields ``{"client", "worker",
    "engine", "ids"}`` (``ids``: file name -> dataset id); ``settings`` go to Settings."""
    from app.web.main import create_app
    from worker.loop import Worker

    settings = Settings(data_dir=data_dir, seed_dir=SHARED_DATA, max_upload_mb=8,
                        admin_user=ADMIN_USER, admin_password=ADMIN_PASSWORD, **settings)
    app = create_app(settings)
    with signed_in(app) as client:
        w = Worker(settings, worker_id=worker_id, poll_interval=0.05)
        w.start()
        ids = {}
        for path in uploads:
            with path.open("rb") as fh:
                r = client.post("/v1/files", files={"file": (path.name, fh)},
                                data={"purpose": "fine-tune"})
            assert r.status_code == 200, r.text
            ids[path.name] = r.json()["id"]
        run_validations(app)
        for _ in range(5):  # the demo model's import
            if repo.get_model(w.engine, "stories260K").status == "ready":
                break
            w.serve(once=True)
        assert repo.get_model(w.engine, "stories260K").status == "ready"
        try:
            yield {"client": client, "worker": w, "engine": w.engine, "ids": ids}
        finally:
            w.stop()
    reset_engines()
