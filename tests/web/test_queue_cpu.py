"""The queue page and /api/queue on a CPU-only machine (the trial's box): a training job waits
for the supervisor's CPU slot (one job at a time), not for GPU memory, and starts at the running
job's ETA; the CPU lane's running and waiting jobs (exports, dataset validations) are listed with
why they wait and an estimated start, other users' jobs anonymous."""
from __future__ import annotations

from sqlmodel import select

from app.store import events, queue, workers
from app.store.admission import Slot
from app.store.db import session_scope
from app.store.schema import Job, JobState, now
from tests.web.conftest import signed_in

CPU_SLOT = Slot("vm-slot", "vm", None, None, None)


def _member(client, name: str) -> str:
    r = client.post("/api/users", json={"name": name, "password": "member-password-1"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _done_export(engine, owner: str, seconds: float) -> None:
    """A succeeded export that took ``seconds`` (what the lane's estimates are made of)."""
    job = queue.enqueue(engine, "export", {}, owner=owner, priority=5)
    with session_scope(engine) as s:
        row = s.get(Job, job.id)
        row.state, row.started_at, row.finished_at = JobState.SUCCEEDED, now() - 1000, \
            now() - 1000 + seconds


def test_cpu_only_queue_gives_true_reasons_and_estimates(app, client, engine) -> None:
    bob, carol = _member(client, "bob"), _member(client, "carol")
    with session_scope(engine) as s:  # the seeded demo model's import: done, out of the way
        for job in s.exec(select(Job).where(Job.state == JobState.QUEUED)):
            job.state = JobState.SUCCEEDED
    workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
    workers.register(engine, "vm-cpu", "vm", 1, "cpu (2 cores, x86_64) (cpu lane)")
    # training on the CPU slot, its newest metric says 600 s left; a second one waits
    first = queue.enqueue(engine, "train", {}, owner=bob, estimate_gib=0.6)
    assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.1, 24.0).id == first.id
    with session_scope(engine) as s:
        events.append(s, first.id, "metric", {"step": 3, "eta_seconds": 600.0})
    second = queue.enqueue(engine, "train", {}, owner=carol, estimate_gib=0.6)
    # the CPU lane: bob's export running (typical export: 240 s), then carol's upload
    # validation and bob's next export wait
    for took in (200.0, 240.0, 300.0):
        _done_export(engine, bob, took)
    export = queue.enqueue(engine, "export", {}, owner=bob, priority=5)
    assert queue.claim(engine, "vm-cpu", 300, ["export"]).id == export.id
    export2 = queue.enqueue(engine, "export", {}, owner=bob, priority=5)
    check = queue.enqueue(engine, "validate_dataset", {"dataset_id": "file-x"}, owner=carol)

    data = client.get("/api/queue").json()
    (wait,) = data["waiting"]
    assert wait["job_id"] == second.id
    assert wait["reason"] == "behind 1 job: the CPU slot (no GPU) runs one job at a time"
    assert 590 <= wait["start_in_seconds"] <= 600
    cpu = data["cpu"]
    assert cpu["lanes"] == 1
    (run,) = cpu["running"]
    assert run["job_id"] == export.id and run["owner"] == "bob"
    assert 230 <= run["eta_seconds"] <= 240  # the median export, just started
    assert [(w["job_id"], w["position"], w["reason"]) for w in cpu["waiting"]] == [
        (check.id, 1, "behind 1 job: the CPU lane runs one job at a time"),
        (export2.id, 2, "behind 2 jobs: the CPU lane runs one job at a time")]
    assert 230 <= cpu["waiting"][0]["start_in_seconds"] <= 240
    assert cpu["waiting"][1]["start_in_seconds"] is None  # no validation has finished yet

    # memory in CPU words, running and waiting (trial s25: "0.6 GiB on the GPU (... + 0.5 GiB
    # CUDA context)" beside "cpu slot (2 cores, one job at a time)")
    (slot,) = data["gpus"]
    for row in (slot["running"][0], wait):
        assert (row["memory"]["short"], row["memory"]["parts"], row["memory"]["admitted"]) == (
            "0.60 GiB estimated", "the GPU estimate for training; a CPU slot runs it in host "
            "memory", None)
    page = client.get("/queue").text
    assert "CUDA context" not in page and "on the GPU" not in page
    assert "behind 1 job: the CPU slot (no GPU) runs one job at a time" in page
    assert "no GPU has room" not in page and "unknown" in page
    assert 'id="cpu-lane"' in page and f"job {check.id}" in page and "in 9 min" in page

    with signed_in(app, "carol", "member-password-1") as c:
        seen = c.get("/api/queue").json()["cpu"]
        assert [(r["visible"], r["job_id"], r["owner"], r["kind"]) for r in seen["running"]] \
            == [(False, None, None, None)]
        assert [(w["visible"], w["job_id"], w["owner"]) for w in seen["waiting"]] == [
            (True, check.id, "carol"), (False, None, None)]
        text = c.get("/queue").text
        assert "another user's job" in text and f"job {export.id}" not in text


def test_cpu_lane_takes_turns_by_owner_and_says_so(app, client, engine) -> None:
    """alice queues 3 exports, then bob 1: the queue page and the dashboard's job list put bob's
    second (the lane's next claim after alice's first), and alice's later ones say they wait for
    their turn; the real claim takes the same order."""
    from app.studio import accounts
    from app.studio import jobs as jobs_uc
    from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER

    alice, bob = _member(client, "alice"), _member(client, "bob")
    with session_scope(engine) as s:  # the seeded demo model's import: done, out of the way
        for job in s.exec(select(Job).where(Job.state == JobState.QUEUED)):
            job.state = JobState.SUCCEEDED
    workers.register(engine, "vm-cpu", "vm", 1, "cpu (2 cores, x86_64) (cpu lane)")
    a = [queue.enqueue(engine, "export", {}, owner=alice, priority=5) for _ in range(3)]
    b = queue.enqueue(engine, "export", {}, owner=bob, priority=5)
    cpu = client.get("/api/queue").json()["cpu"]
    turn = "; waits for its turn: the lane takes turns by owner, 1 newer job of other owners first"
    assert [(w["job_id"], w["position"], w["reason"]) for w in cpu["waiting"]] == [
        (a[0].id, 1, "starts at the next poll"),
        (b.id, 2, "behind 1 job: the CPU lane runs one job at a time"),
        (a[1].id, 3, "behind 2 jobs: the CPU lane runs one job at a time" + turn),
        (a[2].id, 4, "behind 3 jobs: the CPU lane runs one job at a time" + turn)]
    assert "waits for its turn: the lane takes turns by owner" in client.get("/queue").text
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    rows = {r.id: r.position for r in jobs_uc.list_jobs(engine, admin)}
    assert [rows[j.id] for j in (a[0], b, a[1], a[2])] == [1, 2, 3, 4]
    claimed = []
    while (job := queue.claim(engine, "vm-cpu", 60, list(queue.CPU_KINDS))) is not None:
        claimed.append(job.id)
        assert queue.finish(engine, job.id, "vm-cpu")
    assert claimed == [a[0].id, b.id, a[1].id, a[2].id]


def test_cpu_slot_counts_every_job_ahead_with_or_without_an_eta(client, engine) -> None:
    """Trial: right after the first of four runs started (no ETA yet), every waiting job read
    "behind 1 job". Each waits behind the running one and the waiting ones ahead of it; only
    the estimated start depends on the running job's ETA."""
    with session_scope(engine) as s:  # the seeded demo model's import: done, out of the way
        for job in s.exec(select(Job).where(Job.state == JobState.QUEUED)):
            job.state = JobState.SUCCEEDED
    me = client.get("/api/me").json()["id"]
    workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
    jobs = [queue.enqueue(engine, "train", {}, owner=me, estimate_gib=0.6) for _ in range(4)]
    assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.1, 24.0).id == jobs[0].id
    rule = "the CPU slot (no GPU) runs one job at a time"
    expected = [(j.id, f"behind {n} job{'s' if n > 1 else ''}: {rule}")
                for n, j in enumerate(jobs[1:], 1)]
    waiting = client.get("/api/queue").json()["waiting"]
    assert [(w["job_id"], w["reason"]) for w in waiting] == expected
    assert [w["start_in_seconds"] for w in waiting] == [None, None, None]
    with session_scope(engine) as s:  # now the running job reports an ETA
        events.append(s, jobs[0].id, "metric", {"step": 3, "eta_seconds": 600.0})
    waiting = client.get("/api/queue").json()["waiting"]
    assert [(w["job_id"], w["reason"]) for w in waiting] == expected
    assert 590 <= waiting[0]["start_in_seconds"] <= 600
    assert [w["start_in_seconds"] for w in waiting[1:]] == [None, None]  # no typical duration
    page = client.get("/queue").text
    assert f"behind 3 jobs: {rule}" in page


def test_a_member_sees_when_her_jobs_start_behind_another_users_run(app, client, engine):
    """Trial-break F11: alice's waiting runs read "Estimated start unknown" while bob's run
    (anonymous to her) had just started and had reported no ETA yet. The estimate is the same
    for every reader; before a running job's first ETA metric it is the median of its kind
    less the time it has run, so alice sees her start, bob's run staying anonymous."""
    bob, alice = _member(client, "bob"), _member(client, "alice")
    with session_scope(engine) as s:  # the seeded demo model's import: done, out of the way
        for job in s.exec(select(Job).where(Job.state == JobState.QUEUED)):
            job.state = JobState.SUCCEEDED
    workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
    done = queue.enqueue(engine, "train", {}, owner=bob, estimate_gib=0.6)  # took 500 s
    assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.1, 24.0).id == done.id
    with session_scope(engine) as s:
        row = s.get(Job, done.id)
        row.state, row.started_at, row.finished_at = JobState.SUCCEEDED, now() - 900, now() - 400
    running = queue.enqueue(engine, "train", {}, owner=bob, estimate_gib=0.6)
    assert queue.admit(engine, CPU_SLOT, 300, ["train"], 0.1, 24.0).id == running.id
    with session_scope(engine) as s:
        s.get(Job, running.id).started_at = now() - 100  # 100 s in, no ETA metric yet
    hers = [queue.enqueue(engine, "train", {}, owner=alice, estimate_gib=0.6) for _ in range(2)]

    def starts(c) -> list[tuple]:
        data = c.get("/api/queue").json()
        (slot,) = data["gpus"]
        (run,) = slot["running"]
        assert 390 <= run["eta_seconds"] <= 400, run
        return [(w["job_id"], w["visible"], round(w["start_in_seconds"] / 10))
                for w in data["waiting"]]

    expected = [(hers[0].id, True, 40), (hers[1].id, True, 90)]  # 400 s, then 500 s more
    assert starts(client) == expected
    with signed_in(app, "alice", "member-password-1") as c:
        assert starts(c) == expected
        seen = c.get("/api/queue").json()["gpus"][0]["running"][0]
        assert (seen["visible"], seen["job_id"], seen["owner"]) == (False, None, None)
        page = c.get("/queue").text
        waiting = page[page.index("<h2>Waiting"):page.index('id="cpu-lane"')]
        assert waiting.count('class="start">in ') == 2 and "unknown" not in waiting
        assert 'class="start">in 6 min' in waiting
