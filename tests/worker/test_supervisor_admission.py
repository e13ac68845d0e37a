"""Admission with real supervisor processes (``python -m worker --supervise``) on simulated GPUs:
packing several jobs on one GPU, an injected out-of-memory failure that fails alone, fair share
between two users, and the queue page's reasons. Jobs are the fault-test kinds (tick, oom) run in
the supervisor's child processes; each carries an estimate (GiB) as a training job does."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from app.settings import Settings
from app.store import events, queue
from app.store.db import session_scope
from app.store.schema import Job, JobState, User, now
from app.studio.queue_view import queue_view
from faultharness import Studio, ended, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="processes and signals: Linux")

# 24 GiB GPU, 2 GiB reserve -> 22 GiB admissible; an estimate of 6 GiB is admitted with
# 6 x 1.1 + 0.5 (CUDA context) = 7.1 GiB: three fit (21.3), a fourth does not.
SIM = {"simulated_gpus": "1x24", "gpu_reserve_gib": 2, "gpu_admit_margin": 0.1,
       "lease_seconds": 10}


def add_user(engine, name: str, **fields) -> User:
    with session_scope(engine) as s:
        u = User(name=name, password_hash="x", **fields)
        s.add(u)
        s.flush()
        return u


def running(engine) -> list[Job]:
    return queue.list_jobs(engine, JobState.RUNNING)


def span(studio: Studio, job: Job) -> tuple[float, float]:
    """(first, last) tick time of a tick job's newest attempt."""
    files = sorted((Path(studio.data_dir) / "ticks").glob(f"{job.id}-*"))
    ticks = [float(x) for x in files[-1].read_text().split()]
    return ticks[0], ticks[-1]


def settings_of(studio: Studio) -> Settings:
    return Settings(database_url=studio.url, gpu_reserve_gib=2, gpu_admit_margin=0.1,
                    worker_stale_seconds=30)


def test_three_small_jobs_share_one_gpu_and_the_fourth_waits_with_its_reason(tmp_path) -> None:
    studio = Studio(tmp_path, **SIM)
    try:
        eng = studio.engine
        alice = add_user(eng, "alice")
        admin = User(id="user-admin", name="root", password_hash="x", role="admin")
        jobs = [queue.enqueue(eng, "tick", {"seconds": 3.0}, owner=alice.id, estimate_gib=6.0)
                for _ in range(4)]
        studio.worker("sup", "--supervise")
        wait_for(lambda: len(running(eng)) == 3, 60, "three jobs running on one GPU")
        time.sleep(1.0)  # several polls later the fourth still waits
        now_running = running(eng)
        assert len(now_running) == 3 and queue.get_job(eng, jobs[3].id).state == "queued"
        assert {j.gpu_slot for j in now_running} == {"sup-gpu0"}
        assert [j.admitted_gib for j in now_running] == [7.1, 7.1, 7.1]
        view = queue_view(eng, settings_of(studio), admin, kinds=("tick",))
        assert [(g.id, g.capacity_gib, g.admitted_gib, len(g.running)) for g in view.gpus] == [
            ("sup-gpu0", 22.0, 21.3, 3)]
        assert [(w.job_id, w.reason) for w in view.waiting] == [
            (jobs[3].id, "no GPU has room: needs 7.1 GiB, largest free 0.7 GiB")]
        assert all(r.eta_seconds is None for r in view.gpus[0].running)  # tick reports no ETA
        done = [wait_for(lambda j=j: ended(eng, j.id), 60, f"job {j.id} ended") for j in jobs]
        assert [j.state for j in done] == [JobState.SUCCEEDED] * 4
        # compiled kernels are kept under the data dir (survive a container restart)
        assert {j.result["triton_cache_dir"] for j in done} == {
            str((Path(studio.data_dir) / "cache" / "triton").resolve())}
        spans = [span(studio, j) for j in jobs]
        assert max(s for s, _ in spans[:3]) < min(e for _, e in spans[:3])  # truly at once
        assert spans[3][0] >= min(e for _, e in spans[:3])  # the 4th only after one ended
    finally:
        studio.close()


@pytest.mark.slow
def test_an_out_of_memory_job_fails_alone_and_the_next_job_is_admitted(tmp_path) -> None:
    studio = Studio(tmp_path, **SIM)
    try:
        eng = studio.engine
        u = add_user(eng, "alice")
        steady = queue.enqueue(eng, "tick", {"seconds": 8.0}, owner=u.id, estimate_gib=6.0)
        boom = queue.enqueue(eng, "oom", {"seconds": 0.5}, owner=u.id, estimate_gib=6.0)
        # 12 GiB -> 13.7 admitted: fits beside the steady job only once the oom job is gone
        nxt = queue.enqueue(eng, "tick", {"seconds": 0.5}, owner=u.id, estimate_gib=12.0)
        studio.worker("sup", "--supervise")
        failed = wait_for(lambda: ended(eng, boom.id), 60, "the oom job failed")
        assert failed.state == JobState.FAILED
        assert failed.error.startswith("out of GPU memory on GPU 0: estimate 6.0 GiB, admitted "
                                       "with 7.1 GiB, measured peak ")
        assert "Lower per_device_train_batch_size or max_seq_length" in failed.error
        assert "Tried to allocate 20.00 GiB" in failed.error
        got = wait_for(lambda: ended(eng, nxt.id), 60, "the next job ran")
        first = wait_for(lambda: ended(eng, steady.id), 60, "the neighbour finished")
        assert (first.state, got.state) == (JobState.SUCCEEDED, JobState.SUCCEEDED)
        assert first.attempts == 1  # never disturbed
        assert got.started_at < first.finished_at  # admitted beside it, once memory was freed
        assert got.admitted_gib == 13.7
    finally:
        studio.close()


@pytest.mark.slow
def test_fair_share_admits_the_user_with_less_recent_gpu_time_first(tmp_path) -> None:
    studio = Studio(tmp_path, **SIM)
    try:
        eng = studio.engine
        alice, bob = add_user(eng, "alice"), add_user(eng, "bob")
        with session_scope(eng) as s:  # alice used 2 GPU-hours in the last day
            t = now()
            s.add(Job(kind="tick", payload={}, state=JobState.SUCCEEDED, owner=alice.id,
                      gpu_slot="old-gpu0", gpu_index=0, admitted_gib=8.0, started_at=t - 3 * 3600,
                      finished_at=t - 3600))
        # one job at a time (18 GiB -> 20.3 of 22); alice queued first, her later job urgent
        a1 = queue.enqueue(eng, "tick", {"seconds": 0.3}, owner=alice.id, estimate_gib=18.0)
        a2 = queue.enqueue(eng, "tick", {"seconds": 0.3}, owner=alice.id, estimate_gib=18.0,
                           priority=5)
        b1 = queue.enqueue(eng, "tick", {"seconds": 0.3}, owner=bob.id, estimate_gib=18.0)
        b2 = queue.enqueue(eng, "tick", {"seconds": 0.3}, owner=bob.id, estimate_gib=18.0)
        admin = User(id="user-admin", name="root", password_hash="x", role="admin")
        view = queue_view(eng, settings_of(studio), admin, kinds=("tick",))
        assert [w.job_id for w in view.waiting] == [b1.id, b2.id, a2.id, a1.id]
        assert view.waiting[0].reason == "no GPU worker is running"
        studio.worker("sup", "--supervise")
        done = [wait_for(lambda j=j: ended(eng, j.id), 90, f"job {j.id}") for j in
                (a1, a2, b1, b2)]
        order = [j.id for j in sorted(done, key=lambda j: j.started_at)]
        assert order == [b1.id, b2.id, a2.id, a1.id]
        spans = sorted(span(studio, j) for j in (a1, a2, b1, b2))
        assert all(spans[i][1] <= spans[i + 1][0] for i in range(3))  # one at a time
    finally:
        studio.close()


def test_a_job_process_that_outlives_its_claim_is_killed_before_its_slot_is_reused(tmp_path):
    """Trial s22 F12: a job process stuck in C code (a member's regular expression that
    backtracks without end) stops heartbeating, its job is reaped, and its slot was handed to
    the next job while the process ran on beside it (on a GPU: memory counted free while in
    use). Now the slot admits nothing while the orphan lives; it gets SIGTERM after
    ``orphan_grace_seconds`` and SIGKILL after as long again; then the next job runs."""
    import os

    studio = Studio(tmp_path, **{**SIM, "lease_seconds": 3, "reap_interval_seconds": 0.5,
                                 "orphan_grace_seconds": 1})
    try:
        eng = studio.engine
        u = add_user(eng, "bob")
        stuck = queue.enqueue(eng, "wedge", {}, owner=u.id, estimate_gib=6.0, max_attempts=1)
        # 18 GiB -> 20.3 admitted: fits only once the stuck job's 7.1 GiB are free for real
        nxt = queue.enqueue(eng, "tick", {"seconds": 0.5}, owner=u.id, estimate_gib=18.0)
        studio.worker("sup", "--supervise")
        pid_file = Path(studio.data_dir) / "wedge" / str(stuck.id)
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "the wedge started")
        pid = int(pid_file.read_text())
        reaped = wait_for(lambda: ended(eng, stuck.id), 60, "the stuck job reaped")
        assert reaped.state == JobState.FAILED
        os.kill(pid, 0)  # reaped, but its process still runs (and holds its memory)
        started = wait_for(lambda: (lambda j: j if j.started_at else None)(
            queue.get_job(eng, nxt.id)), 60, "the next job admitted")
        assert started.started_at >= reaped.finished_at + 2 * 1.0 - 0.5  # grace, then kill
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone before the slot was reused
        done = wait_for(lambda: ended(eng, nxt.id), 60, "the next job ran")
        assert done.state == JobState.SUCCEEDED
        log = (tmp_path / "sup.log").read_text()
        assert f"job {stuck.id}: its process {pid} outlived its claim" in log
        assert f"job {stuck.id}: its process {pid} still runs" in log and "killing it" in log
    finally:
        studio.close()


def test_a_job_that_does_not_stop_with_the_supervisor_goes_back_saying_why(tmp_path):
    """Trial s27: stopping the studio while a job could not stop (an evaluation busy in C
    code) killed it after the grace and the next start's reaper said "killed (likely out of
    memory ...)". The supervisor that kills it gives the job back to the queue with the cause,
    and does not count the attempt."""
    import signal

    studio = Studio(tmp_path, **{**SIM, "lease_seconds": 60, "stop_grace_seconds": 2})
    try:
        eng = studio.engine
        u = add_user(eng, "bob")
        stuck = queue.enqueue(eng, "wedge", {}, owner=u.id, estimate_gib=6.0, max_attempts=1)
        sup = studio.worker("sup", "--supervise")
        pid_file = Path(studio.data_dir) / "wedge" / str(stuck.id)
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, "the wedge started")
        t0 = time.monotonic()
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(30) == 0
        assert time.monotonic() - t0 < 2 + 10
        job = queue.get_job(eng, stuck.id)
        assert (job.state, job.attempts, job.lease_owner) == (JobState.QUEUED, 0, None)
        reason = events.latest(eng, stuck.id, "state").data["reason"]
        assert reason == ("the worker was stopping and the job did not stop within 2 s, so it "
                          "was ended; it resumes from its last checkpoint")
    finally:
        studio.close()
