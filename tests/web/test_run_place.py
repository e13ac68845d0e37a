"""The run page of a queued run (trial finding): where it stands in the queue, in the Queue
page's words, polled while queued; its ETA from the current attempt only (a resumed run's job
starts with the earlier attempt's metrics); and on a CPU-only box no GPU memory wording."""
from __future__ import annotations

import re

import pytest
from sqlmodel import select

from app.store import events, queue, repo, workers
from app.store.admission import Slot
from app.store.db import session_scope
from app.store.schema import Job, JobState
from tests.web.test_export_checkpoint import _cancel, _checkpoint, _running_run
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

CPU_SLOT = Slot("vm-main", "vm", None, None, None)


def _eta_tile(page: str) -> str:
    return re.search(r'id="m-eta">([^<]*)<', page).group(1)


def _member(client, name: str) -> str:
    r = client.post("/api/users", json={"name": name, "password": "member-password-1"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_queued_run_page_says_where_it_waits_and_only_this_attempts_eta(client, engine,
                                                                       settings) -> None:
    workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
    run_id, first = _running_run(client, engine)  # claimed by a plain worker: running
    events.append_many(engine, first, [("metric", {"step": 2, "loss": 3.0, "eta_seconds": 125.0,
                                                   "memory_gib": 0.4, "memory_kind": "rss"})])
    page = client.get(f"/runs/{run_id}").text
    assert _eta_tile(page).startswith("2 min 0")
    assert 'id="place" data-state="running">' in page and "in the queue" not in page
    _checkpoint(engine, settings, run_id, first, 2)
    _cancel(engine, first)
    with session_scope(engine) as s:  # the dataset check and model import: out of the way
        for job in s.exec(select(Job).where(Job.state == JobState.QUEUED)):
            job.state = JobState.SUCCEEDED
    # bob's training holds the CPU slot (600 s left); carol's waits; then the run is resumed
    bob, carol = _member(client, "bob"), _member(client, "carol")
    held = queue.enqueue(engine, "train", {}, owner=bob, estimate_gib=0.6)
    assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.1, 24.0).id == held.id
    events.append_many(engine, held.id, [("metric", {"step": 1, "eta_seconds": 600.0})])
    queue.enqueue(engine, "train", {}, owner=carol, estimate_gib=0.6)
    assert client.post(f"/runs/{run_id}/resume", follow_redirects=False).status_code == 303
    job = repo.get_run(engine, run_id).job_id

    (mine,) = [w for w in client.get("/api/queue").json()["waiting"] if w["job_id"] == job]
    assert (mine["position"], mine["reason"]) == (
        2, "behind 2 jobs: the CPU slot (no GPU) runs one job at a time")
    page = client.get(f"/runs/{run_id}").text
    assert ("2nd in the queue: behind 2 jobs: the CPU slot (no GPU) runs one job at a time; "
            "estimated start: unknown") in page
    assert '<a href="/queue">see the Queue page</a>' in page
    assert 'hx-get="/runs/%s" hx-trigger="every 5s"' % run_id in page
    assert _eta_tile(page) == "—"  # the copied metric's ETA is the earlier attempt's
    # a CPU-only box: no GPU memory, no CUDA context
    assert "GPU memory" not in page and "CUDA context" not in page
    assert "Memory (CPU worker)" in page and "This run trains on a CPU worker (no GPU)" in page

    # the polled fragment: the place alone, and no more polling once the job runs
    frag = client.get(f"/runs/{run_id}", headers={"HX-Request": "true",
                                                   "HX-Target": "place"}).text
    assert frag.lstrip().startswith('<div id="place"') and "2nd in the queue" in frag
    assert "m-eta" not in frag
    for j in (held.id,):
        queue.finish(engine, j, queue.get_job(engine, j).lease_owner, {})
    with session_scope(engine) as s:  # carol's ran and ended too
        for other in s.exec(select(Job).where(Job.state == JobState.QUEUED, Job.id != job)):
            other.state = JobState.SUCCEEDED
    assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.1, 24.0).id == job
    frag = client.get(f"/runs/{run_id}", headers={"HX-Request": "true",
                                                   "HX-Target": "place"}).text
    assert "in the queue" not in frag and "hx-trigger" not in frag
    page = client.get(f"/runs/{run_id}").text
    assert _eta_tile(page) == "—"  # running, but no metric of this attempt yet
    events.append_many(engine, job, [("metric", {"step": 3, "loss": 2.9, "eta_seconds": 65.0})])
    assert _eta_tile(client.get(f"/runs/{run_id}").text).startswith("1 min 0")


def test_run_page_speaks_of_gpu_memory_on_a_gpu_box(client, engine) -> None:
    workers.register(engine, "box-gpu0", "box", 1, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    run_id, _ = _running_run(client, engine)
    page = client.get(f"/runs/{run_id}").text
    assert "GPU memory" in page and "CUDA context" in page and "Memory (CPU worker)" not in page


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_live_page_of_a_resumed_run_shows_no_eta_of_the_earlier_attempt(page, client, engine,
                                                                       settings):  # noqa: F811
    """The live page replays the resumed job's copied metrics over SSE: their ETA is the
    earlier attempt's and is not shown; the new attempt's first metric is."""
    from playwright.sync_api import expect

    run_id, first = _running_run(client, engine)
    events.append_many(engine, first, [("metric", {"step": 2, "loss": 3.0, "eta_seconds": 125.0})])
    _checkpoint(engine, settings, run_id, first, 2)
    _cancel(engine, first)
    assert client.post(f"/runs/{run_id}/resume", follow_redirects=False).status_code == 303
    page.goto(f"{page.base}/runs/{run_id}")
    expect(page.locator("#log")).to_contain_text("resumed from checkpoint-2")
    expect(page.locator("#m-step")).to_have_text("2")  # the copied metric was replayed
    expect(page.locator("#m-eta")).to_have_text("—")
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    assert job.id == repo.get_run(engine, run_id).job_id
    expect(page.locator("#m-state")).to_have_text("running")
    expect(page.locator("#m-eta")).to_have_text("—")
    events.append_many(engine, job.id, [("metric", {"step": 3, "loss": 2.9,
                                                    "eta_seconds": 65.0})])
    expect(page.locator("#m-eta")).to_have_text("1 min 05 s")
