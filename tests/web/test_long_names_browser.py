"""Long names without spaces (a 250-character file name) wrap inside their table cell: the
datasets, runs and models tables keep every column on screen (trial shot 52)."""
from __future__ import annotations

import pytest

from app.store import repo
from app.store.schema import Model
from app.store.specs import TrainSpec
from tests.web.conftest import run_validations
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]

LONG = "a" * 244 + ".jsonl"  # 250 characters, no space


def _tables_fit(pg) -> list:
    """[(table id-ish, scrollWidth, clientWidth)] of every table wider than its scroll box."""
    return pg.evaluate("""() => [...document.querySelectorAll('.table-scroll')]
        .filter((b) => b.scrollWidth > b.clientWidth + 1)
        .map((b) => [b.closest('[id]')?.id, b.scrollWidth, b.clientWidth])""")


def test_long_names_wrap_in_the_datasets_runs_and_models_tables(page, client, engine):  # noqa: F811
    rows = b'{"instruction": "Say hi", "output": "hi"}\n' * 3
    r = client.post("/datasets", files={"file": (LONG, rows)}, follow_redirects=False)
    ds = r.headers["location"].rsplit("/", 1)[1]
    run_validations(client.app)
    model = client.get("/api/models").json()["data"][0]["id"]
    repo.create_run(engine, TrainSpec(model=model, dataset=ds, max_steps=2))
    repo.add_model(engine, Model(name="m" * 200, source="hf", source_ref="x/" + "y" * 200),
                   import_job=False)
    for path, text in (("/datasets", LONG[:40]), ("/", LONG[:40]), ("/models", "m" * 40)):
        page.goto(page.base + path)
        page.wait_for_selector(f"text={text}")
        assert _tables_fit(page) == [], path
