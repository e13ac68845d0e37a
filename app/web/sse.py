"""Server-sent events for a job, read from ``job_events`` (the database is the only channel).

The stream starts after ``Last-Event-ID`` (a reconnecting browser) or ``?after=`` and sends every
newer event with its row id as the SSE id and its type as the SSE event name. It polls
:func:`app.store.events.since` about twice a second and ends, after a final ``end`` event
without an id, once the job is in a final state and everything has been sent.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from app.store import events, queue
from app.store.schema import JobState

POLL_SECONDS = 0.5
BATCH = 500


def start_after(last_event_id: str | None, after: str | int | None) -> int:
    """The event id to start after: the larger valid one of the header and ``?after=``."""
    best = 0
    for value in (last_event_id, after):
        try:
            best = max(best, int(str(value).strip()))
        except (TypeError, ValueError):
            continue
    return best


def event_payload(ev) -> dict[str, Any]:
    """The JSON body of one SSE message: the event data plus its id, type and time."""
    return {"id": ev.id, "type": ev.type, "ts": ev.ts, **(ev.data or {})}


async def job_event_stream(engine: Engine, job_id: int, after_id: int,
                           poll_seconds: float = POLL_SECONDS) -> AsyncIterator[dict[str, Any]]:
    """Yield sse-starlette message dicts for ``job_id`` from ``after_id`` until the job ends."""
    last = after_id
    while True:
        batch = await run_in_threadpool(events.since, engine, job_id, last, BATCH)
        for ev in batch:
            last = ev.id
            yield {"id": str(ev.id), "event": ev.type, "data": json.dumps(event_payload(ev))}
        if len(batch) == BATCH:
            continue
        job = await run_in_threadpool(queue.get_job, engine, job_id)
        if job.state in JobState.FINAL:
            rest = await run_in_threadpool(events.since, engine, job_id, last, BATCH)
            if not rest:
                yield {"event": "end", "data": json.dumps({"state": job.state})}
                return
            continue
        await asyncio.sleep(poll_seconds)
