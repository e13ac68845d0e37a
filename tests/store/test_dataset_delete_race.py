"""A run created while its dataset is being deleted (trial s27: 2 of 12 racing requests got a
500, SQLite's FOREIGN KEY constraint failed; on a dataset ended runs had used, both requests
succeeded and the new run failed when it started). The dataset is checked again inside the
run's transaction, under the row's lock: either the delete refuses (it sees the queued job) or
the run is refused (NotFound). On SQLite and Postgres."""
from __future__ import annotations

import threading
import time

import pytest

from app.store import queue, repo
from app.store.db import make_engine
from app.store.schema import Dataset, Model
from app.store.specs import TrainSpec
from tests.store.test_queue import url  # noqa: F401 - the SQLite/Postgres fixture


@pytest.fixture()
def engine(url: str):  # noqa: F811
    eng = make_engine(url)
    yield eng
    eng.dispose()


def _rows(engine, named_by_a_run: bool) -> str:
    repo.add_model(engine, Model(id="m-1", name="m", source="local", source_ref="/m",
                                 status="ready", path="/m"), import_job=False)
    repo.add_dataset(engine, Dataset(id="file-1", filename="d.json", path="/nowhere/d.json"))
    if named_by_a_run:  # an ended run used it: its row stays, marked deleted
        _, job = repo.create_run(engine, TrainSpec(model="m-1", dataset="file-1", max_steps=3))
        queue.cancel(engine, job.id)
    return "file-1"


@pytest.mark.parametrize("named_by_a_run", [False, True], ids=["unused", "used-by-ended-run"])
def test_a_delete_between_a_creates_checks_and_its_insert_refuses_the_run(engine, monkeypatch,
                                                           named_by_a_run) -> None:
    ds = _rows(engine, named_by_a_run)
    real, got = repo.session_scope, {}

    def late_scope(engine, immediate=False):  # the create's transaction starts late
        if immediate and threading.current_thread().name == "create":
            time.sleep(0.5)
        return real(engine, immediate=immediate)

    monkeypatch.setattr(repo, "session_scope", late_scope)

    def create() -> None:
        try:
            got["run"] = repo.create_run(engine, TrainSpec(model="m-1", dataset=ds, max_steps=3))
        except Exception as exc:  # noqa: BLE001 - what it raised is the assertion
            got["run"] = exc

    t = threading.Thread(target=create, name="create")
    t.start()
    time.sleep(0.15)
    _, kept = repo.delete_dataset(engine, ds)  # within the create's checks
    t.join(10)
    assert kept is named_by_a_run
    assert isinstance(got["run"], repo.NotFound), got["run"]
    assert str(got["run"]) == "no dataset with id 'file-1'"
    assert len(repo.list_runs(engine)) == int(named_by_a_run)  # no run of the refused create


def test_a_run_created_first_keeps_the_dataset(engine) -> None:
    ds = _rows(engine, named_by_a_run=False)
    run, _ = repo.create_run(engine, TrainSpec(model="m-1", dataset=ds, max_steps=3))
    with pytest.raises(repo.InUse) as e:
        repo.delete_dataset(engine, ds)
    assert e.value.run_id == run.id and e.value.kind == "train"
