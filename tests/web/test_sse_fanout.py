"""The shared per-job SSE feed (app.web.sse) on a real uvicorn server: clients that resume
behind its backlog still get every event once, in order; the poller stops with its last client."""
from __future__ import annotations

import asyncio
import time

from app.store import events, queue
from app.web import sse

from tests.web.test_sse_load import _Reads, _Stream, _export_job, _finish, _http, _wait_first


def _logs(engine, job_id: int, n: int, start: int = 0) -> None:
    events.append_many(engine, job_id, [("log", {"level": "info", "message": f"line {i}"})
                                        for i in range(start, start + n)])


def _ids(stream: _Stream) -> list[int]:
    return [g[2] for g in stream.got if g[2] is not None]


def test_resume_behind_a_small_backlog_gets_every_event_once(server, client, engine, monkeypatch):
    monkeypatch.setattr(sse, "BACKLOG", 5)   # the feed keeps 5 events
    monkeypatch.setattr(sse, "BATCH", 7)     # and reads 7 at a time
    job_id = _export_job(engine)
    _logs(engine, job_id, 30)
    url, auth = f"{server}/api/exports/{job_id}/events", client.headers["Authorization"]
    before = [e.id for e in events.since(engine, job_id, 0, 1000)]
    assert len(before) == 32

    async def main() -> list[_Stream]:
        async with _http() as http:
            first = _Stream()  # starts the feed at 0; it trims to the newest 5
            tasks = [asyncio.create_task(first.read(http, url, auth))]
            for _ in range(200):
                if len(_ids(first)) == len(before):
                    break
                await asyncio.sleep(0.05)
            behind, near = _Stream(), _Stream()
            tasks.append(asyncio.create_task(behind.read(http, f"{url}?after={before[10]}", auth)))
            tasks.append(asyncio.create_task(  # a reconnecting browser
                near.read(http, url, auth, {"Last-Event-ID": str(before[-3])})))
            await _wait_first([behind, near], tasks)
            await asyncio.to_thread(_logs, engine, job_id, 10, 30)  # trims the backlog again
            await _finish(engine, job_id, tasks)
            return [first, behind, near]

    first, behind, near = asyncio.run(main())
    final = [e.id for e in events.since(engine, job_id, 0, 1000)]
    assert len(final) == 32 + 10 + 1
    assert _ids(first) == final
    assert _ids(behind) == final[11:]
    assert _ids(near) == final[30:]
    for s in (first, behind, near):
        assert s.ended and s.got[-1][3] == {"state": "succeeded"}
    messages = [g[3]["message"] for g in behind.got if g[1] == "log"]
    assert messages == [f"line {i}" for i in range(9, 40)]


def test_the_poller_stops_when_its_last_client_leaves(server, client, engine):
    job_id = _export_job(engine)
    url, auth = f"{server}/api/exports/{job_id}/events", client.headers["Authorization"]

    async def reads_in(seconds: float) -> int:
        with _Reads(engine) as reads:
            await asyncio.sleep(seconds)
        return reads.count

    async def main() -> tuple[int, list[int]]:
        async with _http() as http:
            streams = [_Stream() for _ in range(3)]
            tasks = [asyncio.create_task(s.read(http, url, auth)) for s in streams]
            await _wait_first(streams, tasks)
            live = await reads_in(1.0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            after, deadline = [], time.monotonic() + 10
            while time.monotonic() < deadline:
                after.append(await reads_in(0.75))
                if after[-1] == 0:
                    break
            return live, after

    live, after = asyncio.run(main())
    assert 1 <= live <= 2 / sse.POLL_SECONDS  # one poller for three clients: ~4 reads a second
    assert after[-1] == 0, after
    assert queue.get_job(engine, job_id).state == "running"
