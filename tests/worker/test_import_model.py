"""The import_model job for local HF folders and the Hub (offline: a clear error), in-process."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Settings
from app.store import queue, repo
from app.store.db import make_engine
from app.store.migrate import upgrade
from app.store.schema import JobState, Model
from app.store.seed import DEMO_MODEL_NAME, ensure_demo_model
from worker.loop import Worker


@pytest.fixture()
def worker(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    upgrade(url)
    settings = Settings(data_dir=tmp_path, database_url=url)
    w = Worker(settings, worker_id="w-test")
    w.engine = make_engine(url)
    yield w
    w.engine.dispose()


def _run_import(w: Worker, model: Model) -> str:
    job = queue.claim(w.engine, w.worker_id, 60, ["import_model"])
    assert job.payload["model_id"] == model.id
    return w.run_job(job)


def test_local_folder_import(worker, stories_hf: Path) -> None:
    m = repo.add_model(worker.engine, Model(name="local-stories", source="local",
                                            source_ref=str(stories_hf)))
    assert _run_import(worker, m) == JobState.SUCCEEDED
    m = repo.get_model(worker.engine, m.id)
    assert m.status == "ready" and Path(m.path, "config.json").exists()
    assert m.info["params"] == 260032 and m.info["vocab"] == 512 and m.info["layers"] == 5
    assert not list(Path(m.path).parent.glob(".*tmp*"))


def test_bad_local_folder_and_offline_hub_fail_clearly(worker, tmp_path: Path, monkeypatch) -> None:
    m = repo.add_model(worker.engine, Model(name="empty", source="local", source_ref=str(tmp_path)))
    assert _run_import(worker, m) == JobState.FAILED
    m = repo.get_model(worker.engine, m.id)
    assert m.status == "failed" and "config.json" in m.error

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    h = repo.add_model(worker.engine, Model(name="hub", source="hf",
                                            source_ref="karpathy/does-not-exist-here"))
    assert _run_import(worker, h) == JobState.FAILED
    job = queue.list_jobs(worker.engine)[0]
    assert "Hugging Face Hub" in job.error and "\n" not in job.error


def test_ensure_demo_model_is_idempotent(worker) -> None:
    s = worker.settings.model_copy(update={"seed_dir": Path("/nowhere")})
    a = ensure_demo_model(worker.engine, s)
    b = ensure_demo_model(worker.engine, s)
    assert a.id == b.id and a.name == DEMO_MODEL_NAME and a.source == "llama2c"
    assert a.source_ref.startswith("/nowhere/models/stories260K/stories260K.bin|")
    assert len(queue.list_jobs(worker.engine)) == 1


def test_demo_model_without_seed_dir_comes_from_the_hub(tmp_path: Path) -> None:
    from app.store.seed import demo_source_ref

    ref = demo_source_ref(Settings(data_dir=tmp_path, seed_dir=None))
    assert ref == ("hf://karpathy/tinyllamas/stories260K/stories260K.bin|"
                   "hf://karpathy/tinyllamas/stories260K/tok512.bin")
