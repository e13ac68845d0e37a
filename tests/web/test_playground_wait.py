"""A playground session waiting for a worker slot says where it waits (trial finding M-4: the
chat said only "Waiting in the queue for a free slot…" for minutes while the Queue page knew
its position, why and when it would start): the session's status (``GET
/api/playground/sessions/{id}``, the list, the open) carries its ``queue`` place in the Queue
page's words (:func:`app.studio.run_place.run_place`), and the page shows it and keeps it up to
date while it waits.

A CPU-only box: its one CPU slot is held by bob's training job (admitted by admission itself,
with an ETA metric), so the admin's session waits behind it.
"""
from __future__ import annotations

import re

import pytest

from app.store import events, queue, repo, workers
from app.store.admission import Slot
from app.store.schema import JobState
from tests.web.test_web_browser import CHROMIUM, browser_page

CPU_SLOT = Slot("vm-main", "vm", None, None, None)
DEMO = "model-stories260K"
REASON = "behind 1 job: the CPU slot (no GPU) runs one job at a time"


def _busy_cpu_slot(client, engine, eta: float) -> int:
    """Bob's training job holds the box's one CPU slot with ``eta`` seconds left; its id."""
    repo.update_model(engine, DEMO, status="ready")
    workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
    r = client.post("/api/users", json={"name": "bob", "password": "member-password-1"})
    assert r.status_code == 201, r.text
    held = queue.enqueue(engine, "train", {}, owner=r.json()["id"], estimate_gib=0.6)
    assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.1, 24.0).id == held.id
    events.append_many(engine, held.id, [("metric", {"step": 1, "eta_seconds": eta})])
    return held.id


def _starts_in(text: str) -> int:
    m, s = re.search(r"estimated start in (\d+) min (\d+) s", text).groups()
    return int(m) * 60 + int(s)


def test_a_waiting_sessions_status_says_its_place_reason_and_start(client, engine):
    held = _busy_cpu_slot(client, engine, 600.0)
    r = client.post("/api/playground/sessions", json={"model": "stories260K"})
    assert r.status_code == 201, r.text
    opened = r.json()
    assert opened["status"] == "queued"
    assert (opened["queue"]["position"], opened["queue"]["reason"]) == (1, REASON)
    sid = opened["id"]

    got = client.get(f"/api/playground/sessions/{sid}").json()
    place = got["queue"]
    # the Queue page's row for it: the same position, reason and estimated start
    (row,) = [w for w in client.get("/api/queue").json()["waiting"] if w["job_id"] == sid]
    assert (row["position"], row["reason"]) == (place["position"], place["reason"]) == (1, REASON)
    assert 590 <= place["start_in_seconds"] <= 600
    assert abs(row["start_in_seconds"] - place["start_in_seconds"]) < 5
    assert place["text"].startswith(f"1st in the queue: {REASON}; estimated start in 9 min ")
    assert 590 <= _starts_in(place["text"]) <= 600
    (listed,) = client.get("/api/playground/sessions").json()["data"]
    assert listed["queue"]["reason"] == REASON and listed["queue"]["position"] == 1

    # another user's session is still a 404, not its place in the queue
    r = client.post("/api/users", json={"name": "carol", "password": "member-password-1"})
    assert r.status_code == 201
    from tests.web.conftest import signed_in
    with signed_in(client.app, "carol", "member-password-1") as carol:
        assert carol.get(f"/api/playground/sessions/{sid}").status_code == 404

    # once the slot frees and the session is admitted, no queue place any more
    queue.finish(engine, held, queue.get_job(engine, held).lease_owner, {})
    assert queue.admit(engine, CPU_SLOT, 300, ["playground"], 0.1, 24.0).id == sid
    got = client.get(f"/api/playground/sessions/{sid}").json()
    assert (got["status"], got["queue"]) == ("loading", None)
    stopped = client.post(f"/api/playground/sessions/{sid}/stop").json()
    assert (stopped["status"], stopped["queue"]) == ("ended", None)
    assert queue.get_job(engine, sid).state in (JobState.RUNNING, JobState.CANCELLED)


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_the_page_shows_the_place_and_keeps_it_up_to_date(server, client, engine):
    from playwright.sync_api import expect

    held = _busy_cpu_slot(client, engine, 600.0)
    with browser_page(server) as page:
        page.goto(f"{page.base}/playground?model=stories260K")
        page.fill("#pg-prompt", "Once upon a time")
        page.click("#pg-send")
        status = page.locator("#pg-status")
        expect(status).to_contain_text(
            f"Waiting for a free slot: 1st in the queue: {REASON}; estimated start in 9 min")
        assert 590 <= _starts_in(status.text_content()) <= 600
        # the training job reports a new ETA: the waiting message follows it (polled)
        events.append_many(engine, held, [("metric", {"step": 2, "eta_seconds": 180.0})])
        expect(status).to_contain_text(f"{REASON}; estimated start in 2 min", timeout=15_000)
        assert 170 <= _starts_in(status.text_content()) <= 180


def _prompt(client, sid: int) -> str:
    r = client.post(f"/api/playground/sessions/{sid}/prompts",
                    json={"messages": [{"role": "user", "content": "Once upon a time"}]})
    assert r.status_code == 202, r.text
    return r.json()["request_id"]


def test_leaving_a_waiting_sessions_prompt_takes_it_out_of_the_queue(client, engine):
    """What a closed tab sends (trial s24 M-3: sessions of closed tabs stayed queued, then
    loaded the model and held the slot for nobody): its prompt stops, and the session leaves
    the queue once no other prompt waits on it."""
    _busy_cpu_slot(client, engine, 600.0)
    sid = client.post("/api/playground/sessions", json={"model": "stories260K"}).json()["id"]
    first, second = _prompt(client, sid), _prompt(client, sid)  # two tabs on one session

    r = client.post("/api/users", json={"name": "carol", "password": "member-password-1"})
    assert r.status_code == 201
    from tests.web.conftest import signed_in
    with signed_in(client.app, "carol", "member-password-1") as carol:
        assert carol.post(f"/api/playground/sessions/{sid}/prompts/{first}/leave"
                          ).status_code == 404
    r = client.post(f"/api/playground/sessions/{sid}/prompts/no-such-prompt/leave")
    assert r.status_code == 404 and "no-such-prompt" in r.json()["error"]["message"]

    r = client.post(f"/api/playground/sessions/{sid}/prompts/{first}/leave")
    assert r.status_code == 200, r.text
    assert r.json() == {"request_id": first, "session": sid, "left_queue": False}
    assert queue.get_job(engine, sid).state == JobState.QUEUED  # the other tab still waits
    cancels = [e.data["request_id"] for e in events.since(engine, sid, 0, 100, types=["cancel"])]
    assert cancels == [first]

    r = client.post(f"/api/playground/sessions/{sid}/prompts/{second}/leave")
    assert r.json() == {"request_id": second, "session": sid, "left_queue": True}
    assert queue.get_job(engine, sid).state == JobState.CANCELLED


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_a_page_left_while_its_session_waits_takes_it_out_of_the_queue(server, client, engine):
    import time

    from playwright.sync_api import expect

    _busy_cpu_slot(client, engine, 600.0)
    with browser_page(server) as page:
        for leave in ("another page", "closing the tab"):
            page.goto(f"{page.base}/playground?model=stories260K")
            page.fill("#pg-prompt", "Once upon a time")
            page.click("#pg-send")
            expect(page.locator("#pg-status")).to_contain_text("Waiting for a free slot: 1st")
            (sid,) = [j.id for j in queue.list_jobs(engine, JobState.QUEUED)
                      if j.kind == "playground"]
            deadline = time.monotonic() + 10
            while not events.since(engine, sid, 0, 100, types=["prompt"]):
                assert time.monotonic() < deadline, "the prompt was not sent"
                time.sleep(0.1)
            # the page knows its prompt once the POST has answered: only then can leaving it
            # name the prompt (the full suite beside a loaded box closed the tab before that)
            prompt_id = events.since(engine, sid, 0, 100, types=["prompt"])[0].data["request_id"]
            expect(page.locator("#pg-form")).to_have_attribute("data-request-id", prompt_id)
            if leave == "another page":
                page.goto(f"{page.base}/runs")
            else:
                page.close()
            deadline = time.monotonic() + 10
            while queue.get_job(engine, sid).state != JobState.CANCELLED:
                assert time.monotonic() < deadline, f"{leave}: the session stayed queued"
                time.sleep(0.1)
