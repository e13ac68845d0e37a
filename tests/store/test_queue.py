"""The queue protocol on a real SQLite file and, when one is given, a real Postgres server:
racing claimers, leases, reaping, cancel, fencing.

Postgres runs when ``WHETSTONE_TEST_POSTGRES_URL`` names a server URL whose user may create
databases (``make test`` starts a throwaway local server and sets it); each test gets a fresh
database, migrated by Alembic.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
from sqlalchemy import inspect

from app.store import events, queue
from app.store.db import make_engine
from app.store.migrate import upgrade
from app.store.schema import JobState
from tests.store.pgdb import throwaway_database

@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path: Path) -> str:
    if request.param == "sqlite":
        u = f"sqlite:///{tmp_path / 'q.db'}"
        upgrade(u)
        yield u
        return
    with throwaway_database() as u:
        upgrade(u)
        yield u


@pytest.fixture()
def engine(url: str):
    eng = make_engine(url)
    yield eng
    eng.dispose()


def _claimer(url: str, worker_id: str, out) -> None:  # noqa: ANN001
    eng = make_engine(url)
    got = []
    while True:
        job = queue.claim(eng, worker_id, 300)
        if job is None:
            break
        got.append(job.id)
        assert queue.finish(eng, job.id, worker_id, {"by": worker_id})
    out.put((worker_id, got))
    eng.dispose()


def test_migrations_on_empty_db(url: str) -> None:
    u = url  # the fixture migrated an empty database once
    upgrade(u)  # idempotent
    eng = make_engine(u)
    tables = set(inspect(eng).get_table_names())
    assert {"datasets", "models", "runs", "jobs", "job_events", "artifacts", "workers"} <= tables
    assert queue.claim(eng, "w", 10) is None
    eng.dispose()


def test_racing_processes_claim_each_job_exactly_once(url: str, engine) -> None:
    ids = {queue.enqueue(engine, "train", {"i": i}).id for i in range(200)}
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(url, f"w{i}", out)) for i in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    claimed = [j for _, got in results for j in got]
    assert len(claimed) == 200 and set(claimed) == ids  # every job once, none twice
    assert sum(1 for _, got in results if got) >= 2  # it really was a race
    jobs = queue.list_jobs(engine, limit=500)
    assert all(j.state == JobState.SUCCEEDED and j.attempts == 1 for j in jobs)
    by = {j.id: j.result["by"] for j in jobs}
    for wid, got in results:
        assert all(by[j] == wid for j in got)


def test_priority_and_kinds(engine) -> None:
    low = queue.enqueue(engine, "train", {}, priority=0)
    high = queue.enqueue(engine, "import_model", {}, priority=10)
    assert queue.claim(engine, "w", 10, kinds=["train"]).id == low.id
    assert queue.claim(engine, "w", 10).id == high.id


def test_expired_lease_requeued_then_failed_after_max_attempts(engine) -> None:
    job = queue.enqueue(engine, "train", {}, max_attempts=2)
    assert queue.claim(engine, "dead1", 0.05).id == job.id
    time.sleep(0.1)
    assert queue.reap(engine) == [(job.id, JobState.QUEUED)]
    again = queue.claim(engine, "dead2", 0.05)
    assert again.id == job.id and again.attempts == 2
    time.sleep(0.1)
    assert queue.reap(engine) == [(job.id, JobState.FAILED)]
    final = queue.get_job(engine, job.id)
    assert final.state == JobState.FAILED and "max_attempts=2" in final.error
    assert queue.claim(engine, "w", 10) is None


def test_restarted_worker_takes_back_its_jobs_before_the_lease_ends(engine) -> None:
    mine = queue.enqueue(engine, "train", {})
    other = queue.enqueue(engine, "train", {})
    assert queue.claim(engine, "gpu0", 600).id == mine.id  # a long lease: not expired
    assert queue.claim(engine, "gpu1", 600).id == other.id
    assert queue.reap(engine) == []  # nobody's lease ran out
    assert queue.reap(engine, restarted="gpu0") == [(mine.id, JobState.QUEUED)]
    assert queue.get_job(engine, other.id).state == JobState.RUNNING  # another worker's job
    evs = [e.data for e in events.since(engine, mine.id, 0, 100, ["state"])]
    assert evs[-1]["reason"] == "the process of worker gpu0 was killed (likely out of memory); requeued"
    assert queue.claim(engine, "gpu0", 600).id == mine.id


def test_fenced_finish_after_lease_loss(engine) -> None:
    job = queue.enqueue(engine, "train", {})
    queue.claim(engine, "slow", 0.05)
    time.sleep(0.1)
    queue.reap(engine)
    assert queue.claim(engine, "fresh", 60).id == job.id
    assert queue.heartbeat(engine, job.id, "slow", 60).alive is False
    assert queue.finish(engine, job.id, "slow", {"x": 1}) is False
    assert queue.fail(engine, job.id, "slow", "boom") is False
    assert queue.get_job(engine, job.id).state == JobState.RUNNING
    assert queue.finish(engine, job.id, "fresh", {"ok": True}) is True
    assert queue.get_job(engine, job.id).result == {"ok": True}


def test_cancel_queued_and_running(engine) -> None:
    q = queue.enqueue(engine, "train", {})
    r = queue.enqueue(engine, "train", {})
    assert queue.cancel(engine, q.id).state == JobState.CANCELLED
    got = queue.claim(engine, "w", 60)
    assert got.id == r.id  # the cancelled one is never claimed
    assert queue.heartbeat(engine, r.id, "w", 60).cancel_requested is False
    assert queue.cancel(engine, r.id).cancel_requested
    hb = queue.heartbeat(engine, r.id, "w", 60)
    assert hb.alive and hb.cancel_requested
    assert queue.acknowledge_cancel(engine, r.id, "w")
    assert queue.get_job(engine, r.id).state == JobState.CANCELLED
    with pytest.raises(queue.JobNotFound):
        queue.cancel(engine, 99999)


def test_release_returns_job_without_counting_the_attempt(engine) -> None:
    job = queue.enqueue(engine, "train", {})
    queue.claim(engine, "w", 60)
    assert queue.release(engine, job.id, "w", "shutdown")
    j = queue.get_job(engine, job.id)
    assert j.state == JobState.QUEUED and j.attempts == 0 and j.lease_owner is None


def test_the_cpu_lane_takes_turns_by_owner(engine) -> None:
    """alice queues 5 exports, bob 1 after them: one CPU lane claims bob's second, not sixth;
    the page's replay (:func:`queue.claim_order`) predicts the same order before any claim."""
    from app.store.db import session_scope

    def export(owner: str):
        return queue.enqueue(engine, "export", {"format": "adapter"}, priority=5, owner=owner)

    alice = [export("alice") for _ in range(5)]
    bob = export("bob")
    with session_scope(engine) as s:
        predicted = [j.id for j in queue.claim_order(queue.list_jobs(engine, limit=50)[::-1],
                                                     queue.last_turns(s, queue.CPU_KINDS))]
    claimed = []
    while (job := queue.claim(engine, "lane-cpu", 60, kinds=list(queue.CPU_KINDS))) is not None:
        claimed.append(job.id)
        assert queue.finish(engine, job.id, "lane-cpu")
    assert claimed == [alice[0].id, bob.id, *(j.id for j in alice[1:])]
    assert predicted == claimed
    # bob comes back later: his new job goes before alice's newer ones (she had the last turn)
    more = [export("alice"), export("alice")]
    late = export("bob")
    first = queue.claim(engine, "lane-cpu", 60, kinds=list(queue.CPU_KINDS))
    assert first.id == late.id, (first.id, late.id, [j.id for j in more])


def test_a_disabled_owners_cpu_lane_jobs_are_held_until_enabled(engine) -> None:
    """F5 on the CPU lane (exports, imports, validations): the claim skips a disabled owner's
    waiting job (one SQL statement, SQLite and Postgres), the queue page says it is held, and
    enabling the account releases it; a job of no owner is claimed as before."""
    from app.settings import Settings
    from app.store import workers
    from app.store.db import session_scope
    from app.store.schema import User
    from app.studio import accounts
    from app.studio.queue_view import queue_view

    with session_scope(engine) as s:
        bob, boss = User(name="bob", password_hash="x"), User(name="boss", password_hash="x",
                                                              role="admin")
        s.add_all([bob, boss])
    held = queue.enqueue(engine, "export", {"format": "adapter"}, priority=5, owner=bob.id)
    free = queue.enqueue(engine, "validate_dataset", {}, owner=None)
    accounts.set_disabled(engine, boss, bob.id, True)
    kinds = list(queue.CPU_KINDS)
    assert queue.claim(engine, "lane", 60, kinds=kinds).id == free.id
    assert queue.claim(engine, "lane", 60, kinds=kinds) is None  # bob's export waits
    assert queue.claim(engine, "any", 60) is None  # whatever the kinds
    workers.register(engine, "w1 lane", "h", 1, "cpu (cpu lane)")
    (row,) = queue_view(engine, Settings(), boss).cpu.waiting
    assert (row.job_id, row.reason, row.start_in_seconds, row.position) == (
        held.id, "held: its owner's account is disabled; enabling it again releases the job",
        None, 1)
    accounts.set_disabled(engine, boss, bob.id, False)
    assert queue.claim(engine, "lane", 60, kinds=kinds).id == held.id
