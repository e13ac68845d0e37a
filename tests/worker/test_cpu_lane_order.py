"""The CPU lane's claim order with a real supervisor (``python -m worker --supervise``): a dataset
validation queued behind exports (priority 5) is claimed before them, so an upload is checked
promptly (the trial: bob's 17-byte upload waited 17 min behind his four exports, carol's behind
them too); the job list shows it first in the lane before any worker runs."""
from __future__ import annotations

import sys

import pytest

from app.store import events, queue
from app.store.db import session_scope
from app.store.schema import JobState, User
from app.studio import jobs as jobs_uc
from app.studio import validation
from faultharness import Studio, ended, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="processes and signals: Linux")


def add_user(engine, name: str) -> User:
    with session_scope(engine) as s:
        u = User(name=name, password_hash="x", role="admin" if name == "root" else "member")
        s.add(u)
        s.flush()
        return u


def test_a_validation_queued_behind_exports_is_claimed_first(tmp_path) -> None:
    studio = Studio(tmp_path)
    try:
        eng = studio.engine
        bob, carol = add_user(eng, "bob"), add_user(eng, "carol")

        def export():  # as app.studio.exports queues one (the run is gone: it fails at once)
            return queue.enqueue(eng, "export", {"spec_version": 1, "run_id": "ftjob-gone",
                                                 "format": "adapter", "quantization": []},
                                 priority=5, max_attempts=2, owner=bob.id)

        exports = [export(), export()]
        upload = tmp_path / "tiny.jsonl"
        upload.write_text('{"text": "hi"}\n')
        ds = validation.start(eng, carol, "file-tiny", upload, "tiny.jsonl",
                              upload.stat().st_size, "fine-tune", {"mode": "sft"})
        exports.append(export())
        vjob = validation.job_id(ds)
        rows = {r.id: r for r in jobs_uc.list_jobs(eng, add_user(eng, "root"))}
        assert rows[vjob].position == 1
        assert [rows[j.id].position for j in exports] == [2, 3, 4]

        studio.worker("sup", "--supervise")
        for job in [vjob, *(j.id for j in exports)]:
            wait_for(lambda job=job: ended(eng, job), 90, f"job {job} to end")
        claims = {}
        for job in [vjob, *(j.id for j in exports)]:
            first = next(e for e in events.since(eng, job, types=["state"])
                         if e.data["state"] == JobState.RUNNING)
            claims[job] = (first.ts, first.id)
            assert first.data["worker"] == "sup-cpu"  # the supervisor's CPU lane
        order = sorted(claims, key=claims.get)
        assert order == [vjob, *(j.id for j in exports)], order
        assert queue.get_job(eng, vjob).state == JobState.SUCCEEDED
    finally:
        studio.close()
