"""The dashboard's Jobs card as an admin of a busy box meets it: the newest
:data:`app.studio.jobs.DASHBOARD_JOBS` jobs (of every user, or a member's own), how many there
are in all and how many run and wait, and a link to the queue; the page reads a bounded number
of job rows whatever the history."""
from __future__ import annotations

import re

from sqlalchemy import event, func
from sqlmodel import select

from app.store import queue
from app.store.db import session_scope
from app.store.schema import Job, JobState
from tests.web.conftest import signed_in


def _rows(html: str) -> dict[int, str]:
    """The Jobs table's rows by job id (newest first, as listed): id -> its Queue position."""
    table = html[html.index('id="jobs-table"'):]
    table = table[:table.index("</table>")]
    return {int(i): pos for i, pos in re.findall(
        r'<tr data-job="(\d+)".*?<td data-label="Queue position">([^<]*)</td>', table, re.S)}


def test_dashboard_lists_the_newest_jobs_and_counts_the_rest(app, client, engine) -> None:
    admin = client.get("/api/me").json()["id"]
    bea = client.post("/api/users", json={"name": "bea", "password": "member-password-1"}
                      ).json()["id"]
    with session_scope(engine) as s:  # the seeded demo model's import: done, out of the way
        for job in s.exec(select(Job).where(Job.state == JobState.QUEUED)):
            job.state = JobState.SUCCEEDED
    jobs = [queue.enqueue(engine, "export", {}, owner=bea if i % 2 else admin, priority=5)
            for i in range(45)]
    with session_scope(engine) as s:  # 41 ended, an old one still running, the newest 3 wait
        for j in jobs[:42]:
            s.get(Job, j.id).state = JobState.SUCCEEDED
        s.get(Job, jobs[5].id).state = JobState.RUNNING
        total = s.exec(select(func.count()).select_from(Job)).one()
    loaded: list[int] = []

    def on_load(target, _context) -> None:
        loaded.append(target.id)

    event.listen(Job, "load", on_load)
    try:
        html = client.get("/").text
    finally:
        event.remove(Job, "load", on_load)
    rows = _rows(html)
    assert list(rows) == [j.id for j in reversed(jobs[-20:])]  # newest first, 20 of them
    assert [rows[j.id] for j in jobs[-3:]] == ["1", "2", "3"]  # the lane's turns by owner
    assert rows[jobs[-4].id] == "—"
    assert len(loaded) <= 25, len(loaded)  # not every finished job of every user
    assert (f"The newest 20 of {total} jobs of every user: 1 running, 3 waiting. "
            '<a href="/queue">The queue</a> lists every running and waiting job.') in html
    with signed_in(app, "bea", "member-password-1") as c:
        html = c.get("/").text
    rows = _rows(html)
    hers = [j.id for j in jobs if j.owner == bea]
    assert list(rows) == hers[::-1][:20] and rows[jobs[43].id] == "2"
    assert (f"The newest 20 of {len(hers)} jobs: 1 running, 1 waiting. "
            '<a href="/queue">The queue</a>') in html
