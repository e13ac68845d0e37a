"""The queue page and /api/queue over HTTP: per GPU the running jobs, the waiting jobs in
admission order with their reasons; a member sees others' jobs as anonymous slots; an admin moves
a job to the front; quotas on the Admin page; the GPU-hours CSV."""
from __future__ import annotations

import csv
import io
import time

from app.store import queue, workers
from app.store.admission import Slot
from app.store.schema import JobState
from tests.web.conftest import signed_in

GPU = Slot("box-gpu0", "box", 0, 22.0, 24.0)


def _member(client, name: str = "bea") -> str:
    r = client.post("/api/users", json={"name": name, "password": "member-password-1"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def idle_for(engine, monkeypatch, job_id: int, idle_s: float) -> None:
    """Date the events of ``job_id`` ``idle_s`` seconds back and stop the queue view's clock
    (``app.studio.queue_view.now``) there: the idle time and the time to the yield that the
    notes print stay exact however long a loaded machine takes between the test's requests
    (they count whole seconds)."""
    from sqlalchemy import text

    from app.studio import queue_view

    t = time.time()
    monkeypatch.setattr(queue_view, "now", lambda: t)
    with engine.begin() as c:
        c.execute(text("UPDATE job_events SET ts = :ts WHERE job_id = :j"),
                  {"ts": t - idle_s, "j": job_id})


def idle_session(engine, monkeypatch, slot: Slot, owner: str, idle_s: float,
                 estimate_gib: float, payload: dict | None = None) -> int:
    """A playground session admitted on ``slot``, loaded ``idle_s`` seconds ago with no prompt
    since (:func:`idle_for`); returns its job id."""
    from app.store import events

    sid = queue.enqueue(engine, "playground", payload or {}, owner=owner,
                        estimate_gib=estimate_gib).id
    assert queue.admit(engine, slot, 300, ["playground"], 0.1, 24.0).id == sid
    events.append_many(engine, sid, [("session", {"status": "ready"})])
    idle_for(engine, monkeypatch, sid, idle_s)
    return sid


def test_queue_page_explains_every_waiting_job_and_hides_others(app, client, engine,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(app.state.settings, "gpu_admit_margin", 0.1)  # 6 GiB -> 7.1 GiB slots
    admin_id = client.get("/api/me").json()["id"]
    bea = _member(client)
    workers.register(engine, GPU.id, GPU.host, 1, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    mine = [queue.enqueue(engine, "train", {}, owner=admin_id, estimate_gib=6.0).id
            for _ in range(3)]
    hers = queue.enqueue(engine, "train", {}, owner=bea, estimate_gib=6.0).id
    for _ in range(3):
        assert queue.admit(engine, GPU, 300, ["train"], 0.1, 24.0) is not None
    # fair share took bea's job second: the admin's third job waits
    running = {j.id for j in queue.list_jobs(engine, JobState.RUNNING)}
    assert running == {mine[0], hers, mine[1]}
    big = queue.enqueue(engine, "train", {}, owner=bea, estimate_gib=30.0).id
    data = client.get("/api/queue").json()
    assert [(g["id"], g["admitted_gib"], len(g["running"])) for g in data["gpus"]] == [
        ("box-gpu0", 21.3, 3)]
    # bea holds 1 running job, the admin 2: fair share offers bea's next job first
    assert [(w["job_id"], w["reason"]) for w in data["waiting"]] == [
        (big, "too big for every GPU: needs 33.5 GiB, the largest admits 22.0 GiB"),
        (mine[2], "no GPU has room: needs 7.1 GiB, largest free 0.7 GiB")]
    page = client.get("/queue")
    assert page.status_code == 200
    assert "no GPU has room: needs 7.1 GiB, largest free 0.7 GiB" in page.text
    assert "21.3 of 22.0 GiB admitted" in page.text and 'href="/queue"' in page.text
    with signed_in(app, "bea", "member-password-1") as c:
        seen = c.get("/api/queue").json()
        assert sorted((r["visible"], r["job_id"]) for r in seen["gpus"][0]["running"]) == [
            (False, None), (False, None), (True, hers)]
        assert [(w["visible"], w["job_id"]) for w in seen["waiting"]] == [(True, big),
                                                                          (False, None)]
        assert c.post(f"/api/queue/jobs/{big}/front").status_code == 403
        assert c.get("/admin/usage.csv").status_code == 403
    # the admin moves a job to the front
    assert client.post(f"/api/queue/jobs/{mine[2]}/front").status_code == 200
    assert [w["job_id"] for w in client.get("/api/queue").json()["waiting"]] == [mine[2], big]
    r = client.post(f"/queue/jobs/{big}/front", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/queue"
    assert [w["job_id"] for w in client.get("/api/queue").json()["waiting"]] == [big, mine[2]]


def test_admin_sets_quotas_and_downloads_gpu_hours(app, client, engine) -> None:
    bea = _member(client)
    r = client.post(f"/admin/quotas/{bea}", data={"quota_jobs": "2", "quota_gib": "40",
                                                   "quota_gpu_hours": "", "share_weight": "2"},
                    headers={"HX-Request": "true"})
    assert r.status_code == 200 and "Saved the quotas of bea." in r.text
    users = {u["name"]: u for u in client.get("/api/users").json()}
    assert users["bea"]["id"] == bea
    bad = client.post(f"/admin/quotas/{bea}", data={"quota_jobs": "-1"},
                      headers={"HX-Request": "true"})
    assert bad.status_code == 422 and "Jobs at once must be at least 0" in bad.text
    frag = client.get("/admin/quotas").text
    assert 'name="quota_gib" inputmode="decimal" size="6" value="40.0"' in frag
    assert 'hx-get="/admin/quotas"' in client.get("/admin").text
    # one finished GPU job of bea's, 1.5 h long
    job = queue.enqueue(engine, "train", {}, owner=bea, estimate_gib=1.0)
    queue.admit(engine, GPU, 300, ["train"], 0.1, 24.0)
    assert queue.finish(engine, job.id, queue.get_job(engine, job.id).lease_owner, {})
    from app.store.db import session_scope
    from app.store.schema import Job

    with session_scope(engine) as s:
        j = s.get(Job, job.id)
        j.started_at, j.finished_at = j.finished_at - 5400, j.finished_at
        s.add(j)
    rows = list(csv.DictReader(io.StringIO(client.get("/admin/usage.csv").text)))
    assert [(r["job_id"], r["user"], r["gpu"], r["gpu_hours"]) for r in rows] == [
        (str(job.id), "bea", "box-gpu0", "1.5000")]


def test_queue_says_an_idle_playground_session_gives_its_slot_to_a_waiting_job(
        app, client, engine, monkeypatch) -> None:
    from app.store import events

    monkeypatch.setattr(app.state.settings, "gpu_admit_margin", 0.1)
    admin_id = client.get("/api/me").json()["id"]
    _member(client)
    workers.register(engine, GPU.id, GPU.host, 1, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    sid = queue.enqueue(engine, "playground", {}, owner=admin_id, estimate_gib=15.0).id
    assert queue.admit(engine, GPU, 300, ["playground"], 0.1, 24.0).id == sid
    # loading, nothing waits: the rule is said all the same
    row = client.get("/api/queue").json()["gpus"][0]["running"][0]
    assert row["note"] == ("playground session, loading its model; once idle it gives its "
                           "slot to waiting jobs after 15 s idle")
    events.append_many(engine, sid, [("session", {"status": "ready"})])
    idle_for(engine, monkeypatch, sid, 40)  # loaded 40 s ago, no prompt since
    data = client.get("/api/queue").json()
    assert data["playground_yield_seconds"] == 15.0
    assert data["gpus"][0]["running"][0]["note"] == (
        "idle playground session, idle 40 s: no job waits for its slot; it gives the slot up "
        "after 15 s idle when one does")
    # a training job that fits only once the session ended waits behind it
    train = queue.enqueue(engine, "train", {}, owner=admin_id, estimate_gib=10.0).id
    data = client.get("/api/queue").json()
    assert data["gpus"][0]["running"][0]["note"] == (
        f"idle playground session, idle 40 s, past its 15 s yield: it gives its slot to job "
        f"{train} within seconds")
    wait = data["waiting"][0]
    assert wait["job_id"] == train and wait["reason"].startswith("no GPU has room")
    assert wait["note"] == (
        f"waits for playground session job {sid} on cuda:0 NVIDIA test: idle 40 s, past its "
        "15 s yield; it gives its slot within seconds")
    page = client.get("/queue").text
    assert f"gives its slot to job {train} within seconds" in page and wait["note"] in page
    # a prompt in flight: the session is busy
    events.append_many(engine, sid, [("prompt", {"request_id": "r1"})])
    data = client.get("/api/queue").json()
    assert data["waiting"][0]["note"].endswith("it is answering a prompt now")
    # a member sees the rule without whose session it is
    with signed_in(app, "bea", "member-password-1") as c:
        seen = c.get("/api/queue").json()
        assert seen["gpus"][0]["running"][0]["note"].startswith(
            "playground session, answering a prompt; once idle it gives its slot to waiting "
            "jobs after 15 s idle")
        assert seen["waiting"][0]["note"].startswith(
            "waits for another user's playground session on cuda:0 NVIDIA test:")


def test_on_a_cpu_slot_the_waiting_job_hears_when_the_session_yields(app, client, engine,
                                                                     monkeypatch) -> None:
    admin_id = client.get("/api/me").json()["id"]
    cpu = Slot("box-main", "box", None, None, None)
    workers.register(engine, cpu.id, cpu.host, 1, "cpu slot (2 cores, one job at a time)")
    sid = idle_session(engine, monkeypatch, cpu, admin_id, 5, 0.1)
    train = queue.enqueue(engine, "train", {}, owner=admin_id, estimate_gib=1.0).id
    data = client.get("/api/queue").json()
    assert data["gpus"][0]["running"][0]["note"] == (
        f"idle playground session, idle 5 s: gives its slot to job {train} in 10 s (at 15 s "
        "idle) unless it gets a prompt")
    assert data["waiting"][0]["reason"] == (
        "behind 1 job: the CPU slot (no GPU) runs one job at a time")
    assert data["waiting"][0]["note"] == (
        f"waits for playground session job {sid} on the CPU slot: idle 5 s; it gives its slot "
        "in 10 s (at 15 s idle) unless it gets a prompt")


def test_quota_messages_read_right(app, client, engine) -> None:
    """Trial wording: a quota of 1e999 or NaN must be a finite number (not "at least 0"); the
    over-quota reason agrees in number ("your 1 running job reaches") and names the owner for
    an admin reading another user's job."""
    bea = _member(client)
    for raw in ("1e999", "NaN", "-inf"):
        r = client.post(f"/admin/quotas/{bea}", data={"quota_gib": raw},
                        headers={"HX-Request": "true"})
        assert r.status_code == 422 and "at least" not in r.text, raw
        assert "GPU memory at once (GiB) must be a finite number (empty: no limit)" in r.text, raw
    r = client.post(f"/admin/quotas/{bea}", data={"quota_gpu_hours": "2e9"},
                    headers={"HX-Request": "true"})
    assert r.status_code == 422 and "GPU-hours a day must be at most 1000000000" in r.text
    r = client.post(f"/admin/quotas/{bea}", data={"quota_jobs": "1", "quota_gib": "",
                                                   "quota_gpu_hours": "", "share_weight": "1"},
                    headers={"HX-Request": "true"})
    assert r.status_code == 200, r.text
    workers.register(engine, GPU.id, GPU.host, 1, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    first = queue.enqueue(engine, "train", {}, owner=bea, estimate_gib=1.0).id
    assert queue.admit(engine, GPU, 300, ["train"], 0.1, 24.0).id == first
    second = queue.enqueue(engine, "train", {}, owner=bea, estimate_gib=1.0).id
    (row,) = client.get("/api/queue").json()["waiting"]
    assert (row["job_id"], row["reason"]) == (
        second, "over quota: bea's 1 running job reaches bea's limit of 1 at once")
    with signed_in(app, "bea", "member-password-1") as c:
        (row,) = c.get("/api/queue").json()["waiting"]
        assert row["reason"] == "over quota: your 1 running job reaches your limit of 1 at once"
        assert "your 1 running job reaches your limit of 1 at once" in c.get("/queue").text
