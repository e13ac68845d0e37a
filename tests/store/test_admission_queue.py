"""Admission on the real queue (app.store.queue.admit): racing admitters on SQLite and Postgres
never over-admit a GPU or a user's quota; each quota holds with its reason on the queue page;
fair-share weights; an admin's move to the front; the too-big refusal less the reserve."""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from app.settings import Settings
from app.store import queue, workers
from app.store.admission import Slot, need_gib, order, snapshot
from app.store.db import make_engine, session_scope
from app.store.migrate import upgrade
from app.store.schema import Job, JobState, User, now
from app.studio import calibration, quotas
from app.studio.errors import StudioError
from app.studio.estimate import Estimate
from app.studio.queue_view import queue_view
from tests.store.test_queue import url  # noqa: F401 - the SQLite/Postgres fixture

GPU0 = Slot("hostA-gpu0", "hostA", 0, 22.0, 24.0)  # a 24 GiB GPU less a 2 GiB reserve
ADMIN = User(id="user-root", name="root", password_hash="x", role="admin")
SETTINGS = Settings(gpu_reserve_gib=2, gpu_admit_margin=0.1, worker_stale_seconds=30)


@pytest.fixture()
def engine(tmp_path: Path):
    u = f"sqlite:///{tmp_path / 'a.db'}"
    upgrade(u)
    eng = make_engine(u)
    yield eng
    eng.dispose()


def add_user(engine, name: str, **fields) -> User:
    with session_scope(engine) as s:
        u = User(name=name, password_hash="x", **fields)
        s.add(u)
        s.flush()
        return u


def gpu_slot_row(engine, slot: Slot) -> None:
    workers.register(engine, slot.id, slot.host, 1, f"cuda:{slot.index} test", slot.total_gib,
                     slot.index, slot.capacity_gib)


def _admitter(url: str, slots: list[Slot], kinds: list[str], seconds: float,
              out) -> None:  # noqa: ANN001
    """Admit onto ``slots`` for at least ``seconds`` and until 25 rounds in a row admit nothing
    (a loaded machine may need longer to fill the GPUs; 60 s at most)."""
    eng = make_engine(url)
    got, start, idle = [], time.monotonic(), 0
    while time.monotonic() - start < 60 and (time.monotonic() - start < seconds or idle < 25):
        idle += 1
        for slot in slots:
            job = queue.admit(eng, slot, 300, kinds, 0.1, 24.0)
            if job is not None:
                got.append(job.id)
                idle = 0
    out.put(got)
    eng.dispose()


def test_racing_admitters_never_over_admit_a_gpu_or_a_quota(url: str) -> None:
    eng = make_engine(url)
    try:
        capped = add_user(eng, "capped", quota_jobs=2)
        free = add_user(eng, "free")
        big = Slot("hostB-gpu0", "hostB", 0, 78.0, 80.0)
        for i in range(12):  # 6 GiB -> 7.1 admitted: 3 fit on GPU0, 10 on `big`
            kind = ("train", "grpo")[i % 2]  # admitters of different kinds pick different jobs
            queue.enqueue(eng, kind, {}, owner=capped.id, estimate_gib=6.0)
            queue.enqueue(eng, kind, {}, owner=free.id, estimate_gib=6.0)
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        out = ctx.Queue()
        kinds = (["train"], ["grpo"], ["train", "grpo"])
        procs = [ctx.Process(target=_admitter, args=(url, [GPU0, big] if i % 2 else [big, GPU0],
                                                     kinds[i % 3], 3.0, out)) for i in range(6)]
        for p in procs:
            p.start()
        got = [x for _ in procs for x in out.get(timeout=90)]
        for p in procs:
            p.join(30)
        run = queue.list_jobs(eng, JobState.RUNNING)
        assert sorted(got) == sorted(j.id for j in run)  # each admitted once, by one admitter
        per_slot = {s.id: sum(j.admitted_gib for j in run if j.gpu_slot == s.id) for s in
                    (GPU0, big)}
        assert per_slot == {GPU0.id: pytest.approx(21.3), big.id: pytest.approx(71.0)}
        assert sum(j.owner == capped.id for j in run) == 2  # the quota, across both GPUs
        assert len(run) == 13
    finally:
        eng.dispose()


def test_each_quota_holds_with_its_reason(engine) -> None:
    gpu_slot_row(engine, Slot("h-gpu0", "h", 0, 78.0, 80.0))
    slot = Slot("h-gpu0", "h", 0, 78.0, 80.0)
    by_jobs = add_user(engine, "jobs2", quota_jobs=2)
    by_gib = add_user(engine, "gib20", quota_gib=20.0)
    by_hours = add_user(engine, "hours1", quota_gpu_hours=1.0)
    other = add_user(engine, "other")
    with session_scope(engine) as s:  # hours1 ran 1.5 GPU-hours in the last day
        t = now()
        s.add(Job(kind="train", payload={}, state=JobState.SUCCEEDED, owner=by_hours.id,
                  gpu_slot="x", gpu_index=0, started_at=t - 7200, finished_at=t - 1800))
    ids = {u.name: [queue.enqueue(engine, "train", {}, owner=u.id, estimate_gib=8.0).id
                    for _ in range(3)] for u in (by_jobs, by_gib, by_hours, other)}
    while queue.admit(engine, slot, 300, ["train"], 0.1, 24.0) is not None:
        pass
    run = queue.list_jobs(engine, JobState.RUNNING)
    per = {name: sum(j.id in js for j in run) for name, js in ids.items()}
    # 9.3 GiB each: jobs2 2 (its limit), gib20 2 (18.6 of 20), hours1 none, other 3; 7 x 9.3 = 65.1
    assert per == {"jobs2": 2, "gib20": 2, "hours1": 0, "other": 3}
    view = queue_view(engine, SETTINGS, ADMIN, kinds=("train",))
    reasons = {w.job_id: w.reason for w in view.waiting}
    # the admin reads other users' jobs: the reason names their owner, not "your"
    assert reasons[ids["jobs2"][2]] == ("over quota: jobs2's 2 running jobs reach jobs2's limit "
                                        "of 2 at once")
    assert reasons[ids["gib20"][2]] == ("over quota: gib20's 2 running jobs hold 18.6 GiB of "
                                        "gib20's 20 GiB; this one needs 9.3 GiB")
    assert reasons[ids["hours1"][0]] == ("over quota: hours1 used 1.50 GPU-hours in the last "
                                         "24 h (limit 1)")
    # the owner reads their own
    as_owner = User(id=by_jobs.id, name="jobs2", password_hash="x")
    own = {w.job_id: w.reason for w in queue_view(engine, SETTINGS, as_owner,
                                                  kinds=("train",)).waiting if w.visible}
    assert own[ids["jobs2"][2]] == "over quota: your 2 running jobs reach your limit of 2 at once"
    assert len(reasons) == 5  # jobs2 1, gib20 1, hours1 3
    # a member sees another's over-quota job as an anonymous slot
    member = User(id=other.id, name="other", password_hash="x")
    mine = queue_view(engine, SETTINGS, member, kinds=("train",))
    assert [(w.visible, w.job_id, w.reason) for w in mine.waiting][0] == (
        False, None, "over its owner's quota")
    assert sum(r.visible for g in mine.gpus for r in g.running) == 3
    # an admin lifts the job limit: the next admission takes jobs2's third job
    quotas.set_quota(engine, ADMIN, by_jobs.id, jobs="", gib="", gpu_hours="", weight="1")
    assert queue.admit(engine, slot, 300, ["train"], 0.1, 24.0).id == ids["jobs2"][2]


def test_fair_share_follows_recent_gpu_time_over_the_admins_weights(engine) -> None:
    heavy = add_user(engine, "heavy", share_weight=4.0)  # 2 h used, weight 4 -> 0.5 h
    light = add_user(engine, "light")  # 1 h used, weight 1
    t = now()
    with session_scope(engine) as s:
        for u, hours in ((heavy, 2.0), (light, 1.0)):
            s.add(Job(kind="train", payload={}, state=JobState.SUCCEEDED, owner=u.id, gpu_slot="x",
                      gpu_index=0, started_at=t - 3600 * (hours + 1), finished_at=t - 3600))
    lo = [queue.enqueue(engine, "train", {}, owner=light.id, estimate_gib=1.0).id for _ in range(2)]
    hi = [queue.enqueue(engine, "train", {}, owner=heavy.id, estimate_gib=1.0).id
          for _ in range(2)]
    with session_scope(engine) as s:
        ordered = [j.id for j in order(snapshot(s, now(), ["train"], 0.1, 24.0))]
    # heavy: 7200 s / 4 = 1800 first, then + 600 / 4 per pick; light: 3600 s / 1
    assert ordered == [hi[0], hi[1], lo[0], lo[1]]
    quotas.set_quota(engine, ADMIN, heavy.id, weight="1")  # equal weights: light first
    with session_scope(engine) as s:
        assert [j.id for j in order(snapshot(s, now(), ["train"], 0.1, 24.0))][:2] == lo


def test_an_admin_moves_a_job_to_the_front(engine) -> None:
    u = add_user(engine, "u")
    member = User(id=u.id, name="u", password_hash="x")
    jobs = [queue.enqueue(engine, "train", {}, owner=u.id, estimate_gib=18.0).id
            for _ in range(3)]
    with pytest.raises(StudioError) as exc:
        quotas.move_to_front(engine, member, jobs[2])
    assert exc.value.kind == "forbidden"
    quotas.move_to_front(engine, ADMIN, jobs[2])
    assert [w.job_id for w in queue_view(engine, SETTINGS, ADMIN, kinds=("train",)).waiting] \
        == [jobs[2], jobs[0], jobs[1]]
    assert queue.admit(engine, GPU0, 300, ["train"], 0.1, 24.0).id == jobs[2]
    with pytest.raises(StudioError) as exc:
        quotas.move_to_front(engine, ADMIN, jobs[2])  # running now
    assert exc.value.kind == "conflict"


def test_a_job_too_big_for_every_gpu_less_the_reserve_is_refused(engine) -> None:
    workers.register(engine, "h-gpu0", "h", 1, "cuda:0 test", 24.0, 0, 22.0)
    settings = Settings(gpu_reserve_gib=2, gpu_admit_margin=0.1, worker_stale_seconds=30)
    fits = Estimate(weights_gib=19.0, allocated_gib=19.0, context_gib=0.5, total_gib=19.5)
    calibration.check_fits(engine, settings, fits)  # 19 x 1.1 + 0.5 = 21.4 <= 22
    big = Estimate(weights_gib=20.0, allocated_gib=20.0, context_gib=0.5, total_gib=20.5)
    with pytest.raises(StudioError) as exc:  # 22.5 > 22 though 20.5 < 24
        calibration.check_fits(engine, settings, big)
    assert exc.value.code == "too_big_for_gpus"
    assert ("22.5 GiB with the 10% admission margin; the largest GPU of the live workers has "
            "24.0 GiB, 22.0 GiB admissible after the reserve") in exc.value.message
    assert need_gib(20.0, 0.1, 22.0) == 22.5 and need_gib(None, 0.1, 22.0) == 22.0


def test_a_disabled_or_paused_owners_waiting_jobs_are_held_by_the_claim(url: str) -> None:
    """F5/F12: an admin disables bob, or sets carol's Jobs at once to 0: the real admission
    claim (SQLite and Postgres) skips their waiting jobs however free the GPU is, the queue
    says why, a job already running goes on, and enabling / raising the quota releases them."""
    eng = make_engine(url)
    try:
        slot = Slot("h-gpu0", "h", 0, 78.0, 80.0)
        gpu_slot_row(eng, slot)
        bob, carol, dave = (add_user(eng, n) for n in ("bob", "carol", "dave"))
        running = queue.enqueue(eng, "train", {}, owner=bob.id, estimate_gib=4.0)
        assert queue.admit(eng, slot, 300, ["train"], 0.1, 24.0).id == running.id
        b = queue.enqueue(eng, "train", {}, owner=bob.id, estimate_gib=4.0)
        c = queue.enqueue(eng, "train", {}, owner=carol.id, estimate_gib=4.0)
        d = queue.enqueue(eng, "train", {}, owner=dave.id, estimate_gib=4.0)
        from app.studio import accounts
        admin = add_user(eng, "boss", role="admin")
        accounts.set_disabled(eng, admin, bob.id, True)
        quotas.set_quota(eng, admin, carol.id, jobs="0", gib="", gpu_hours="", weight="1")
        got = []
        while (job := queue.admit(eng, slot, 300, ["train"], 0.1, 24.0)) is not None:
            got.append(job.id)
        assert got == [d.id]  # 62 GiB free: only dave's starts
        assert queue.get_job(eng, running.id).state == JobState.RUNNING  # bob's running goes on
        assert {queue.get_job(eng, i).state for i in (b.id, c.id)} == {JobState.QUEUED}
        view = queue_view(eng, SETTINGS, admin, kinds=("train",))
        assert {w.job_id: w.reason for w in view.waiting} == {
            b.id: "held: bob's account is disabled; enabling it again releases the job",
            c.id: "held: Jobs at once is 0 for carol; raising it on the Admin page releases "
                  "the job"}
        as_carol = queue_view(eng, SETTINGS, carol, kinds=("train",))
        assert sorted((w.visible, w.reason) for w in as_carol.waiting) == [
            (False, "held: its owner's account is disabled"),
            (True, "held: Jobs at once is 0 for you; ask an admin")]
        accounts.set_disabled(eng, admin, bob.id, False)
        quotas.set_quota(eng, admin, carol.id, jobs="1", gib="", gpu_hours="", weight="1")
        got = {queue.admit(eng, slot, 300, ["train"], 0.1, 24.0).id for _ in range(2)}
        assert got == {b.id, c.id}
    finally:
        eng.dispose()


def test_a_reaped_jobs_live_process_holds_its_slot_inside_the_admission(url: str) -> None:
    """Trial s22 F12's race (seen again as a flake of test_supervisor_admission): the supervisor
    looks at its processes, the reaper then fails a job whose process still runs, and the
    admission that follows must not hand that slot on. The claims the supervisor passes are
    checked inside the admission's transaction (SQLite and Postgres): the slot admits nothing
    while the reaped job's process is claimed, the other slot admits, and a multi-GPU job does
    not take the held slot as a peer; once the process is gone (no claim) the slot admits."""
    from sqlalchemy import update

    eng = make_engine(url)
    try:
        s0, s1 = Slot("h-gpu0", "h", 0, 22.0, 24.0), Slot("h-gpu1", "h", 1, 22.0, 24.0)
        for s in (s0, s1):
            gpu_slot_row(eng, s)
        u = add_user(eng, "bob")
        stuck = queue.enqueue(eng, "train", {}, owner=u.id, estimate_gib=6.0, max_attempts=1)
        got = queue.admit(eng, s0, 300, ["train"], 0.1, 24.0)
        assert got.id == stuck.id
        owner = got.lease_owner
        live = [(stuck.id, owner, (s0.id,))]
        nxt = queue.enqueue(eng, "train", {}, owner=u.id, estimate_gib=18.0)
        # its lease ran out: the reaper fails it (its process, claimed above, still runs)
        with session_scope(eng) as s:
            s.exec(update(Job).where(Job.id == stuck.id).values(lease_expires_at=now() - 1))
        assert queue.reap(eng) == [(stuck.id, JobState.FAILED)]
        assert queue.admit(eng, s0, 300, ["train"], 0.1, 24.0, claims=live) is None
        assert queue.get_job(eng, nxt.id).state == JobState.QUEUED
        # a job still running under its owner holds nothing: s1's claim does not stop s1
        ok = queue.admit(eng, s1, 300, ["train"], 0.1, 24.0, peers=[s0, s1], claims=live)
        assert ok.id == nxt.id and ok.gpu_slot == s1.id
        # without the claim (the process exited) s0 admits again
        again = queue.enqueue(eng, "train", {}, owner=u.id, estimate_gib=6.0)
        assert queue.admit(eng, s0, 300, ["train"], 0.1, 24.0, claims=live) is None
        mine = [(ok.id, ok.lease_owner, (s1.id,))]
        assert queue.admit(eng, s0, 300, ["train"], 0.1, 24.0, claims=mine).id == again.id
    finally:
        eng.dispose()
