"""Server-sent events for a job, read from ``job_events`` (the database is the only channel).

The stream starts after ``Last-Event-ID`` (a reconnecting browser) or ``?after=`` and sends every
newer event with its row id as the SSE id and its type as the SSE event name. It ends, after a
final ``end`` event without an id, once the job is in a final state and everything has been sent.

One poller per job serves every client of that job (issue 20, "Load"): a :class:`JobFeed`,
an asyncio task started by the first subscriber, reads new events and the job's state in one
thread-pool call every :data:`POLL_SECONDS`, keeps the newest :data:`BACKLOG` events as
ready-made SSE messages and wakes its subscribers; each subscriber sends from the backlog the
events after its own position. A subscriber that starts (or falls) behind the backlog reads
the older events straight from the database first, so a resume never misses one. The task ends
once the job's final state has been read, and is cancelled when its last subscriber leaves.
Feeds are kept per event loop, so each server (or test client) thread has its own.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from sqlalchemy.engine import Engine
from sse_starlette.event import ServerSentEvent
from starlette.concurrency import run_in_threadpool

from app.store import events, queue
from app.store.schema import JobState

log = logging.getLogger("whetstone.web")

# 4 polls a second: a new event reaches every client within ~0.25 s + delivery (target p99
# < 0.5 s); the cost is one thread-pool call per watched job, not per client.
POLL_SECONDS = 0.25
BATCH = 500
BACKLOG = 1000        # newest events a feed keeps for its subscribers
POLL_RETRIES = 3      # consecutive failed polls (a busy database) before the streams end


def start_after(last_event_id: str | None, after: str | int | None) -> int:
    """The event id to start after: the larger valid one of the header and ``?after=``.

    A value that is not a non-negative integer within SQLite's int64 range
    (:func:`events.parse_id`) is ignored, as the SSE spec lets a server ignore a
    ``Last-Event-ID`` it cannot use: the stream then starts from the beginning."""
    return max((n for n in map(events.parse_id, (last_event_id, after)) if n is not None),
               default=0)


def event_payload(ev) -> dict[str, Any]:
    """The JSON body of one SSE message: the event data plus its id, type and time."""
    return {"id": ev.id, "type": ev.type, "ts": ev.ts, **(ev.data or {})}


def encode_event(ev) -> bytes:
    """One event as SSE bytes: its row id as the SSE id, its type as the event name and
    :func:`event_payload` as JSON data (``EventSourceResponse``'s default line separator)."""
    data = json.dumps(event_payload(ev))
    return ServerSentEvent(id=str(ev.id), event=ev.type, data=data).encode()


def encode_end(state: str) -> bytes:
    """The closing ``end`` message (no id) with the job's final state."""
    return ServerSentEvent(event="end", data=json.dumps({"state": state})).encode()


def poll_job(engine: Engine, job_id: int, after_id: int) -> tuple[list, str | None, bool]:
    """One poll (blocking; run it in a thread): ``(events after after_id, final state or None,
    more)``. The final state is returned only when no event follows the ones returned; ``more``
    says a full batch was read and the next poll should not wait."""
    batch = events.since(engine, job_id, after_id, BATCH)
    if len(batch) == BATCH:
        return batch, None, True
    job = queue.get_job(engine, job_id)
    if job.state not in JobState.FINAL:
        return batch, None, False
    # events written just before the final state: read once more after seeing it
    rest = events.since(engine, job_id, batch[-1].id if batch else after_id, BATCH)
    return batch + rest, (None if rest else job.state), bool(rest)


class JobFeed:
    """The shared poller of one job's events on one event loop, and its backlog.

    The backlog holds every event with ``base < id <= last``, encoded once; ``final`` is the
    encoded ``end`` message once the job is final and every event is in; ``error`` the exception
    that stopped the poller, if one did.
    """

    def __init__(self, engine: Engine, job_id: int, start_id: int, poll_seconds: float) -> None:
        self.engine, self.job_id, self.poll_seconds = engine, job_id, poll_seconds
        self.base = self.last = start_id
        self._ids: list[int] = []
        self._msgs: list[bytes] = []
        self.final: bytes | None = None
        self.error: BaseException | None = None
        self.subscribers = 0
        self.task: asyncio.Task | None = None
        self.registry: dict[tuple[Engine, int], JobFeed] = {}
        self._changed = asyncio.Event()

    def after(self, cursor: int) -> tuple[int, bytes]:
        """``(newest id, the backlog's messages after cursor as one chunk)``; ``(cursor, b"")``
        when there is none."""
        i = bisect.bisect_right(self._ids, cursor)
        if i == len(self._ids):
            return cursor, b""
        return self._ids[-1], b"".join(self._msgs[i:])

    async def changed(self) -> None:
        """Wait until the next poll brings events, the final state or an error."""
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _add(self, batch: list) -> None:
        for ev in batch:
            if ev.id > self.last:
                self._ids.append(ev.id)
                self._msgs.append(encode_event(ev))
                self.last = ev.id
        drop = len(self._ids) - BACKLOG
        if drop > 0:
            self.base = self._ids[drop - 1]
            del self._ids[:drop], self._msgs[:drop]

    async def run(self) -> None:
        """Poll until the job is final (or the task is cancelled); wake subscribers per poll."""
        failures = 0
        try:
            while True:
                try:
                    batch, state, more = await run_in_threadpool(
                        poll_job, self.engine, self.job_id, self.last)
                except queue.JobNotFound:
                    raise
                except Exception:  # noqa: BLE001 - a busy database: retry a few times
                    failures += 1
                    if failures > POLL_RETRIES:
                        raise
                    log.warning("polling job %s events failed; retrying", self.job_id,
                                exc_info=True)
                    await asyncio.sleep(self.poll_seconds)
                    continue
                failures = 0
                self._add(batch)
                if state is not None:
                    self.final = encode_end(state)
                if batch or state is not None:
                    self._wake()
                if state is not None:
                    return
                if not more:
                    await asyncio.sleep(self.poll_seconds)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to every subscriber, which raises it
            self.error = exc
            self._wake()


_feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> {(engine, job): feed}
_feeds_lock = threading.Lock()


def _loop_feeds() -> dict[tuple[Engine, int], JobFeed]:
    loop = asyncio.get_running_loop()
    with _feeds_lock:
        feeds = _feeds.get(loop)
        if feeds is None:
            feeds = _feeds[loop] = {}
        return feeds


def subscribe(engine: Engine, job_id: int, after_id: int,
              poll_seconds: float = POLL_SECONDS) -> JobFeed:
    """The running loop's feed of ``job_id`` (started from ``after_id`` when there is none, or
    when the last one failed), with one more subscriber. Pair with :func:`unsubscribe`."""
    feeds = _loop_feeds()
    feed = feeds.get((engine, job_id))
    if feed is None or feed.error is not None:
        feed = feeds[(engine, job_id)] = JobFeed(engine, job_id, after_id, poll_seconds)
        feed.registry = feeds
        feed.task = asyncio.get_running_loop().create_task(
            feed.run(), name=f"sse-feed-job-{job_id}")
    feed.subscribers += 1
    return feed


def unsubscribe(feed: JobFeed) -> None:
    """One subscriber fewer; the last one out stops the feed's poller and forgets the feed."""
    feed.subscribers -= 1
    if feed.subscribers > 0:
        return
    if feed.registry.get((feed.engine, feed.job_id)) is feed:
        del feed.registry[(feed.engine, feed.job_id)]
    if feed.task is not None and not feed.task.done():
        feed.task.cancel()


def active_feeds() -> int:
    """How many job feeds the running event loop holds (each one poller)."""
    return len(_loop_feeds())


#: How often a long stream re-checks that its caller is still signed in (seconds).
AUTH_RECHECK_SECONDS = 5.0


async def while_signed_in(stream: AsyncIterator[bytes], still_signed_in: Callable[[], bool],
                          every: float | None = None) -> AsyncIterator[bytes]:
    """``stream``'s chunks for as long as ``still_signed_in()`` (blocking; run in the thread pool
    every ``every`` seconds, default :data:`AUTH_RECHECK_SECONDS`, idle or not) holds: signing
    out, revoking the key or disabling the user ends an open stream within that time, not only
    new ones."""
    every = AUTH_RECHECK_SECONDS if every is None else every
    loop = asyncio.get_running_loop()
    it = stream.__aiter__()
    pending: asyncio.Future | None = None
    due = loop.time() + every
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=max(0.0, due - loop.time()))
            if pending in done:
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    pending = None
                    return
                pending = None
                yield chunk
            if loop.time() >= due:
                if not await run_in_threadpool(still_signed_in):
                    return
                due = loop.time() + every
    finally:
        if pending is not None:  # let the inner generator see the cancel before closing it
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
        await it.aclose()


async def job_event_stream(engine: Engine, job_id: int, after_id: int,
                           poll_seconds: float = POLL_SECONDS) -> AsyncIterator[bytes]:
    """Yield encoded SSE messages (bytes, for ``EventSourceResponse``) for ``job_id`` from
    ``after_id`` until the job ends; all the events ready at once go out as one chunk.

    Served by the job's shared :class:`JobFeed`; events older than its backlog are read from
    the database for this subscriber alone. ``poll_seconds`` (seconds) applies when this call
    starts the feed. A cursor past the job's newest event is no id this job ever sent (a
    bad ``Last-Event-ID``): it is ignored and the stream starts from the beginning, so it can
    neither skip events nor start the shared feed where other subscribers would miss some."""
    if after_id > 0 and after_id > await run_in_threadpool(events.newest_id, engine, job_id):
        after_id = 0
    feed = subscribe(engine, job_id, after_id, poll_seconds)
    try:
        cursor = after_id
        while True:
            if cursor < feed.base:  # behind the backlog: read the gap from the database
                base = feed.base
                batch = await run_in_threadpool(events.since, engine, job_id, cursor, BATCH)
                if batch:
                    cursor = batch[-1].id
                    yield b"".join(encode_event(ev) for ev in batch)
                if len(batch) < BATCH:
                    cursor = max(cursor, base)
                continue
            cursor, chunk = feed.after(cursor)
            if chunk:
                yield chunk
                continue
            if feed.error is not None:
                raise RuntimeError(f"job {job_id}: reading its events failed") from feed.error
            if feed.final is not None:
                yield feed.final
                return
            await feed.changed()
    finally:
        unsubscribe(feed)
