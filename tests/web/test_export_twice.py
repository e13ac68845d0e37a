"""The same export asked twice while the first is queued or running is one export (trial s24:
a double click on Export, or a client's retry, queued two identical jobs): ``POST
/api/runs/{id}/exports`` answers the live one (200, not 201), the page's form shows one row, and
a different export, or the same one after the first ended, is queued as a new job. The worker
is simulated through the store, the channel it uses."""
from __future__ import annotations

from sqlmodel import select

from app.store import queue
from app.store.db import session_scope
from app.store.schema import Job, JobState
from tests.web.test_export_checkpoint import _cancel, _checkpoint, _running_run


def _exports(engine, run_id: str) -> list[Job]:
    with session_scope(engine) as s:
        return list(s.exec(select(Job).where(Job.kind == "export", Job.run_id == run_id)
                           .order_by(Job.id)).all())


def test_the_same_export_twice_is_one_job(client, engine, settings):
    run_id, job_id = _running_run(client, engine)
    _checkpoint(engine, settings, run_id, job_id, 2)
    _cancel(engine, job_id)  # a cancelled run exports its newest checkpoint

    first = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    assert first.status_code == 201, first.text
    again = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    assert again.status_code == 200, again.text
    assert again.json() == first.json()
    # the page's form (a double click): still one
    r = client.post(f"/runs/{run_id}/exports", data={"format": "adapter"})
    assert r.status_code == 200, r.text
    assert [j.id for j in _exports(engine, run_id)] == [first.json()["id"]]

    # another export of the run is its own job
    gguf = client.post(f"/api/runs/{run_id}/exports",
                       json={"format": "gguf", "quantization": ["Q8_0"]})
    assert gguf.status_code == 201 and gguf.json()["id"] != first.json()["id"]
    # once the first is running, the same again is still it; once it ended, a new one
    queue.claim(engine, "w-export", 30, kinds=["export"])
    assert queue.get_job(engine, first.json()["id"]).state == JobState.RUNNING
    assert client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"}).status_code == 200
    queue.fail(engine, first.json()["id"], "w-export", "disk full")
    later = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    assert later.status_code == 201 and later.json()["id"] not in (first.json()["id"],
                                                                   gguf.json()["id"])
    assert len(_exports(engine, run_id)) == 3
