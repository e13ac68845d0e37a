"""SSE under load (issue 20, "Load"): a real uvicorn server on 127.0.0.1 and many httpx streams of
one job's events while the test appends events through ``app.store.events``.

(a) 200 concurrent streams: the time from each request to its first event (target: all within
1 s), and a new stream's while the 200 are open; (b) 50 clients while events arrive: the delay
from an event's commit to its delivery, p50 and p99 over every client (target: p99 < 0.5 s).
Both print the measured figures; the asserts leave a margin for CI's two busy cores."""
from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import httpx
import pytest
from sqlalchemy import event as sa_event

from app.store import events, queue

STREAMS = 200
RAMP = 2.0                # seconds over which the 200 streams open
HISTORY = 100             # events the job has before the streams open
STREAM_EVENT_GAP = 0.2    # seconds between events appended while the 200 stream
CLIENTS = 50
EVENTS = 40
EVENT_GAP = 0.1           # seconds between appended events in (b)
FIRST_EVENT_LIMIT = 2.0   # seconds; target 1 s, doubled for CI
P99_LIMIT = 1.0           # seconds; target 0.5 s, doubled for CI
DEADLINE = 90.0           # seconds; bounds every wait below


def _token(client) -> str:
    return client.headers["Authorization"]


def _export_job(engine) -> int:
    """A running export job (unowned: the admin may see it) with its queued and running events."""
    job = queue.enqueue(engine, "export", {"format": "adapter"})
    claimed = queue.claim(engine, "load-test", 600, kinds=["export"])
    assert claimed is not None and claimed.id == job.id
    return job.id


class _Stream:
    """One SSE client: the messages it received as (receive time, event, id, data)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.got: list[tuple[float, str, int | None, dict]] = []
        self.first = asyncio.Event()
        self.ended = False

    async def read(self, http: httpx.AsyncClient, url: str, auth: str,
                   headers: dict[str, str] | None = None) -> None:
        self.started = time.perf_counter()
        async with http.stream("GET", url, headers={"Authorization": auth, **(headers or {})}) as r:
            assert r.status_code == 200, r.status_code
            ev: dict[str, str] = {}
            async for line in r.aiter_lines():
                if line:
                    if ":" in line and not line.startswith(":"):
                        k, v = line.split(":", 1)
                        ev[k] = v.strip()
                    continue
                if "data" in ev:
                    self.got.append((time.perf_counter(), ev.get("event", "message"),
                                     int(ev["id"]) if "id" in ev else None, json.loads(ev["data"])))
                    self.first.set()
                    if ev.get("event") == "end":
                        self.ended = True
                        return
                ev = {}

    def first_delay(self) -> float:
        return self.got[0][0] - self.started if self.got else float("inf")


def _http() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(DEADLINE))


async def _wait_first(streams: list[_Stream], tasks: list[asyncio.Task]) -> None:
    waits = [asyncio.ensure_future(s.first.wait()) for s in streams]
    done, pending = await asyncio.wait(waits, timeout=DEADLINE)
    for w in pending:
        w.cancel()
    for t in tasks:
        if t.done() and t.exception() is not None:
            raise t.exception()


async def _finish(engine, job_id: int, tasks: list[asyncio.Task]) -> None:
    assert await asyncio.to_thread(queue.finish, engine, job_id, "load-test", {})
    done, pending = await asyncio.wait(tasks, timeout=DEADLINE)
    for t in pending:
        t.cancel()
    assert not pending, f"{len(pending)} streams did not end"
    for t in done:
        if t.exception() is not None:
            raise t.exception()


class _Reads:
    """Counts the engine's SELECTs of job events (every stream's database polls)."""

    def __init__(self, engine) -> None:
        self.engine, self.count = engine, 0

    def _seen(self, conn, cursor, statement, *args) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM job_events" in statement:
            self.count += 1

    def __enter__(self) -> "_Reads":
        sa_event.listen(self.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc) -> None:
        sa_event.remove(self.engine, "before_cursor_execute", self._seen)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Appender:
    """Appends a metric event every ``gap`` seconds from a thread (a training worker's
    stream) until stopped; each carries its commit-side time as ``sent`` (epoch seconds)."""

    def __init__(self, engine, job_id: int, gap: float) -> None:
        self.engine, self.job_id, self.gap, self.steps = engine, job_id, gap, 0
        self.stop = threading.Event()

    def run(self, limit: int | None = None) -> None:
        deadline = time.monotonic() + DEADLINE
        while not self.stop.is_set() and time.monotonic() < deadline:
            self.steps += 1
            events.append_many(self.engine, self.job_id,
                               [("metric", {"step": self.steps, "sent": time.time()})])
            if limit is not None and self.steps >= limit:
                return
            self.stop.wait(self.gap)


@pytest.mark.slow
def test_200_streams_each_get_their_first_event_within_a_second(server, client, engine):
    job_id = _export_job(engine)
    url, auth = f"{server}/api/exports/{job_id}/events", _token(client)
    events.append_many(engine, job_id, [("log", {"level": "info", "message": f"line {i}"})
                                        for i in range(HISTORY)])
    feed = _Appender(engine, job_id, STREAM_EVENT_GAP)

    async def main() -> tuple[list[float], float, list[_Stream]]:
        async with _http() as http:
            appending = asyncio.create_task(asyncio.to_thread(feed.run))
            streams, tasks = [], []
            for _ in range(STREAMS):  # browsers opening the run page over ~2 s
                streams.append(_Stream())
                tasks.append(asyncio.create_task(streams[-1].read(http, url, auth)))
                await asyncio.sleep(RAMP / STREAMS)
            await _wait_first(streams, tasks)
            firsts = [s.first_delay() for s in streams]
            await asyncio.sleep(1.0)  # all 200 streaming while events arrive
            late = _Stream()  # then one more
            tasks.append(asyncio.create_task(late.read(http, url, auth)))
            await _wait_first([late], tasks)
            streams.append(late)
            feed.stop.set()
            await appending
            await _finish(engine, job_id, tasks)
            return firsts, late.first_delay(), streams

    firsts, late, streams = asyncio.run(main())
    print(f"\n{STREAMS} streams opened over {RAMP:.0f} s while events arrive, first event: "
          f"p50 {statistics.median(firsts):.3f} s, p99 {_percentile(firsts, 0.99):.3f} s, "
          f"max {max(firsts):.3f} s; one more stream among them: {late:.3f} s")
    final = [e.id for e in events.since(engine, job_id, 0, 100_000)]
    assert len(final) == 2 + HISTORY + feed.steps + 1  # queued, running, ..., succeeded
    for s in streams:  # every stream got every event in order, then `end` with the final state
        assert [g[2] for g in s.got if g[2] is not None] == final and s.ended
        assert s.got[-1][1] == "end" and s.got[-1][3] == {"state": "succeeded"}
    assert max(firsts) < FIRST_EVENT_LIMIT and late < FIRST_EVENT_LIMIT


@pytest.mark.slow
def test_50_clients_get_each_new_event_within_half_a_second(server, client, engine):
    job_id = _export_job(engine)
    url, auth = f"{server}/api/exports/{job_id}/events", _token(client)

    async def main() -> list[_Stream]:
        async with _http() as http:
            streams = [_Stream() for _ in range(CLIENTS)]
            tasks = [asyncio.create_task(s.read(http, url, auth)) for s in streams]
            await _wait_first(streams, tasks)
            with _Reads(engine) as reads:
                t0 = time.perf_counter()
                await asyncio.to_thread(_Appender(engine, job_id, EVENT_GAP).run, EVENTS)
                polls_per_second = reads.count / (time.perf_counter() - t0)
            await _finish(engine, job_id, tasks)
            return streams, polls_per_second

    wall_then = time.time() - time.perf_counter()  # perf_counter -> epoch seconds
    streams, polls_per_second = asyncio.run(main())
    delays = [got + wall_then - data["sent"]
              for s in streams for got, kind, _, data in s.got if kind == "metric"]
    p50, p99 = statistics.median(delays), _percentile(delays, 0.99)
    print(f"\n{CLIENTS} clients x {EVENTS} events: delivery p50 {p50:.3f} s, p99 {p99:.3f} s, "
          f"max {max(delays):.3f} s; event reads {polls_per_second:.1f}/s")
    for s in streams:
        steps = [data["step"] for _, kind, _, data in s.got if kind == "metric"]
        assert steps == list(range(1, EVENTS + 1)) and s.ended
    assert len(delays) == CLIENTS * EVENTS
    assert p99 < P99_LIMIT
    # one poller for the job, not one per client (50 clients polling twice a second: ~100/s)
    assert polls_per_second < 10
