"""Chaos: N jobs through M real worker processes while random workers are SIGKILLed (and
restarted, as docker/start.sh does) and others SIGSTOPped for a moment. Every job must end
succeeded (0 lost, 0 stuck) and be recorded as succeeded exactly once (0 duplicate outputs)."""
from __future__ import annotations

import random
import signal
import sys
import time

import pytest

from app.store import events, queue
from app.store.schema import JobState
from faultharness import Studio, wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="signals: Linux")]

N_JOBS, M_WORKERS, BUDGET_S = 20, 3, 110


def test_chaos_random_kills_lose_nothing(tmp_path) -> None:
    rng = random.Random(20)
    studio = Studio(tmp_path, lease_seconds=2, heartbeat_seconds=0.3)
    try:
        eng = studio.engine
        jobs = [queue.enqueue(eng, "tick", {"seconds": rng.uniform(1.0, 4.0)}, max_attempts=20)
                for _ in range(N_JOBS)]
        procs = {f"w{i}": studio.worker(f"w{i}") for i in range(M_WORKERS)}
        wait_for(lambda: len(queue.list_jobs(eng, JobState.RUNNING)) == M_WORKERS, 60,
                 "every worker busy")
        kills = stops = 0
        deadline = time.monotonic() + BUDGET_S
        while time.monotonic() < deadline:
            if all(queue.get_job(eng, j.id).state in JobState.FINAL for j in jobs):
                break
            time.sleep(rng.uniform(0.5, 2.0))
            holding = sorted({j.lease_owner for j in queue.list_jobs(eng, JobState.RUNNING)}
                             & set(procs))
            wid = rng.choice(holding or sorted(procs))  # mostly a worker in the middle of a job
            if kills < 10 and rng.random() < 0.7:
                procs[wid].kill()
                procs[wid].wait(10)
                kills += 1
                procs[wid] = studio.worker(wid)  # restarted under its id, as start.sh does
            elif stops < 5:
                procs[wid].send_signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.2, 3.0))  # sometimes past its lease
                procs[wid].send_signal(signal.SIGCONT)
                stops += 1
        final = [queue.get_job(eng, j.id) for j in jobs]
        print(f"chaos: {kills} SIGKILLs, {stops} SIGSTOPs, attempts "
              f"{sorted(j.attempts for j in final)}")
        assert [j.id for j in final if j.state != JobState.SUCCEEDED] == [], \
            [(j.id, j.state, j.error) for j in final]  # 0 lost, 0 stuck
        for j in final:  # 0 duplicates: one success each, by a worker that held the lease
            succeeded = [e for e in events.since(eng, j.id, 0, 10_000, ["state"])
                         if e.data["state"] == JobState.SUCCEEDED]
            assert len(succeeded) == 1, j.id
            assert j.result["by"] in procs
        assert kills >= 3
    finally:
        studio.close()
