"""Bad SSE cursors (``Last-Event-ID``, ``?after=``) and event-id query cursors: ignored or a
clear 400, never a database overflow, and one client's bad cursor never costs another client
events on the shared per-job feed (app.web.sse)."""
from __future__ import annotations

import asyncio

from app.store import events, queue

from tests.web.test_sse_load import _export_job, _finish, _http, _Stream
from tests.web.test_web_runs import _sse, _start_run

HUGE = "99999999999999999999999"   # past SQLite's int64: used to raise OverflowError
FUTURE = str(2**62)               # a valid int64, but no event of the job has that id


def test_bad_cursors_start_the_run_stream_from_the_beginning(client, engine):
    run_id, job = _start_run(client, engine)
    events.append_many(engine, job.id, [("log", {"level": "info", "message": f"line {i}"})
                                        for i in range(3)])
    assert queue.finish(engine, job.id, "test-worker", result={})
    every = [e.id for e in events.since(engine, job.id, 0, 100)]
    cases = [({"Last-Event-ID": HUGE}, ""), ({"Last-Event-ID": FUTURE}, ""),
             ({}, f"?after={HUGE}"), ({}, "?after=-5"), ({}, "?after=1e3"),
             ({"Last-Event-ID": "abc"}, f"?after={FUTURE}")]
    for headers, query in cases:
        with client.stream("GET", f"/runs/{run_id}/events{query}", headers=headers) as r:
            assert r.status_code == 200
            got = _sse("".join(r.iter_text()))
        assert [int(e["id"]) for e in got if "id" in e] == every, (headers, query)
        assert got[-1]["event"] == "end" and '"succeeded"' in got[-1]["data"]
    # a valid cursor still resumes after it
    with client.stream("GET", f"/runs/{run_id}/events",
                       headers={"Last-Event-ID": str(every[1])}) as r:
        assert [int(e["id"]) for e in _sse("".join(r.iter_text())) if "id" in e] == every[2:]


def test_a_bad_cursor_does_not_cost_another_client_events(server, client, engine):
    job_id = _export_job(engine)
    url, auth = f"{server}/api/exports/{job_id}/events", client.headers["Authorization"]

    async def main() -> tuple[_Stream, _Stream]:
        async with _http() as http:
            bad, good = _Stream(), _Stream()
            tasks = [asyncio.create_task(bad.read(http, url, auth, {"Last-Event-ID": FUTURE}))]
            await asyncio.sleep(0.5)  # the bad cursor's client starts the job's shared feed
            tasks.append(asyncio.create_task(good.read(http, url, auth)))
            await asyncio.wait_for(good.first.wait(), 20)
            await asyncio.to_thread(events.append_many, engine, job_id,
                                    [("log", {"level": "info", "message": "later"})])
            for _ in range(100):
                if any(g[1] == "log" for g in good.got):
                    break
                await asyncio.sleep(0.05)
            await _finish(engine, job_id, tasks)
            return bad, good

    bad, good = asyncio.run(main())
    every = [e.id for e in events.since(engine, job_id, 0, 100)]
    for s in (bad, good):
        assert [g[2] for g in s.got if g[2] is not None] == every
        assert s.ended and s.got[-1][3] == {"state": "succeeded"}
    assert [g[3]["message"] for g in good.got if g[1] == "log"] == ["later"]


def test_event_id_query_cursors_out_of_range(client, engine):
    run_id, _ = _start_run(client, engine)
    r = client.get(f"/v1/fine_tuning/jobs/{run_id}/events",
                   params={"after": f"ftevent-{HUGE}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    r = client.get(f"/v1/fine_tuning/jobs/{run_id}/events", params={"after": f"ftevent-{FUTURE}"})
    assert r.status_code == 200 and len(r.json()["data"]) >= 1
    for q in (f"before={HUGE}", f"after={HUGE}"):
        page = client.get(f"/admin?{q}")
        assert page.status_code == 200 and "Traceback" not in page.text, q
