"""A playground session holds a worker slot: against the real supervisor process (its CPU slot
runs one job at a time, as a GPU box's slot holds a session's memory) and the app on a real
uvicorn, with the demo model stories260K (a base-model session, no training needed).

* an idle session keeps its slot while nothing waits, and gives it up after the short grace
  (``playground_yield_seconds``) once a queued job waits for it, saying so;
* a ``/v1/chat/completions`` caller who disconnects stops the server's wait, and its retry reuses
  the live session;
* a session waiting for the slot is listed on ``/api/queue`` and ``/queue`` with its reason, and
  concurrent opens make one session;
* a prompt can be stopped (the API, the page's Stop button): the partial reply stays, marked;
* signed out in another tab, the page says so instead of waiting forever.

The tests keep the loaded session for the next when they can (each load is a worker child that
imports torch: seconds on a busy 2-core box).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx
import pytest

from app.settings import Settings
from app.store import events, queue
from app.store.db import reset_engines
from app.store.schema import JobState
from tests.conftest import REPO, SHARED_DATA, STORIES
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, served
from tests.web.test_web_browser import CHROMIUM, browser_page, sign_out_elsewhere

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(),
                                reason=f"no test data at {SHARED_DATA}")

GRACE = 1.0  # seconds an idle session keeps a slot a queued job waits for
MODEL = "stories260K"
PROMPT = [{"role": "user", "content": "Once upon a time"}]


def wait(predicate, timeout: float, what: str, every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = predicate()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    from app.studio import accounts
    from app.web.main import create_app

    d = tmp_path_factory.mktemp("pg-slot")
    settings = Settings(data_dir=d / "data", seed_dir=SHARED_DATA, admin_user=ADMIN_USER,
                        admin_password=ADMIN_PASSWORD, heartbeat_seconds=0.5,
                        playground_idle_seconds=120, playground_yield_seconds=GRACE)
    app = create_app(settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHETSTONE_")}
    env.update({"WHETSTONE_DATA_DIR": str(d / "data"), "WHETSTONE_SEED_DIR": str(SHARED_DATA),
                "WHETSTONE_HEARTBEAT_SECONDS": "0.5", "CUDA_VISIBLE_DEVICES": "",
                "WHETSTONE_ADMIN_USER": ADMIN_USER, "WHETSTONE_ADMIN_PASSWORD": ADMIN_PASSWORD,
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": str(REPO)})
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(served(app))
        engine = app.state.engine
        log = open(d / "worker.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--supervise",
                                 "--poll-interval", "0.2"], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
            key = accounts.create_api_key(engine, admin, "tests")[1]
            http = stack.enter_context(httpx.Client(
                base_url=base, timeout=60, headers={"Authorization": f"Bearer {key}"}))
            wait(lambda: any(m["name"] == MODEL and m["status"] == "ready"
                             for m in http.get("/api/models").json()["data"]), 120,
                 "the demo model's import")
            yield {"engine": engine, "http": http, "base": base, "key": key, "admin": admin,
                   "log": d / "worker.log"}
        finally:
            proc.terminate()  # SIGTERM: the supervisor stops its children
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
            log.close()
    reset_engines()


def _ended(engine, job_id: int, timeout: float = 30.0):
    return wait(lambda: (j := queue.get_job(engine, job_id)).state in JobState.FINAL and j,
                timeout, f"session {job_id} to end")


def _answer(engine, job_id: int, rid: str, timeout: float = 60.0) -> dict:
    def got():
        for ev in events.since(engine, job_id, 0, 10000, types=["answer"]):
            if ev.data.get("request_id") == rid:
                return ev.data
        return None
    return wait(got, timeout, f"the answer to {rid}")


def _chat(box, **extra) -> tuple[dict, dict]:
    http = box["http"]
    r = http.post("/api/playground/sessions", json={"model": MODEL})
    assert r.status_code in (200, 201), r.text
    s = r.json()
    r = http.post(f"/api/playground/sessions/{s['id']}/prompts",
                  json={"messages": PROMPT, "temperature": 0, "max_tokens": 8, **extra})
    assert r.status_code == 202, r.text
    return s, r.json()


def _stop_all(box) -> None:
    from app.store.db import session_scope
    from app.store.schema import Job
    from sqlmodel import select

    with session_scope(box["engine"]) as s:
        live = s.exec(select(Job.id).where(Job.state.in_([JobState.QUEUED, JobState.RUNNING]),
                                           Job.kind != "hold")).all()
    for job_id in live:
        queue.cancel(box["engine"], job_id)
    for job_id in live:
        _ended(box["engine"], job_id)


def _sessions(engine) -> list:
    from sqlmodel import select

    from app.store.db import session_scope
    from app.store.schema import Job

    with session_scope(engine) as s:
        return list(s.exec(select(Job).where(Job.kind == "playground").order_by(Job.id)).all())


def _prompts(engine, job_id: int) -> list[str]:
    return [e.data["request_id"] for e in events.since(engine, job_id, 0, 10000,
                                                       types=["prompt"])]


def _cancelled(engine, job_id: int) -> set[str]:
    return {e.data["request_id"] for e in events.since(engine, job_id, 0, 10000,
                                                       types=["cancel"])}


def _hold_slot(box):
    """Another job holds the one CPU slot: admitted by admission itself (no worker runs its kind
    ``hold``, so it holds the slot until the test ends it with ``queue.finish``)."""
    from app.store import admission, workers

    engine = box["engine"]
    _stop_all(box)
    slot = next(sl for sl in admission.slots_of(workers.live(engine, 30)) if sl.index is None)
    queue.enqueue(engine, "hold", {}, owner=box["admin"].id, max_attempts=1)
    held = queue.admit(engine, slot, 60, ["hold"], Settings().gpu_admit_margin, 24.0)
    assert held is not None and held.gpu_slot == slot.id
    return held


def _release(box, held) -> None:
    """Stop the sessions (queued: at once), then end the job holding the slot."""
    _stop_all(box)
    assert queue.finish(box["engine"], held.id, held.lease_owner, {})


def test_an_idle_session_frees_its_slot_for_a_queued_job(box):
    engine, http = box["engine"], box["http"]
    s, sent = _chat(box)
    assert _answer(engine, s["id"], sent["request_id"])["text"]
    # nothing waits: it keeps the slot past the grace
    time.sleep(GRACE + 1.5)
    assert queue.get_job(engine, s["id"]).state == JobState.RUNNING
    # a job waits for the one CPU slot: the session ends within the grace and a check
    waiting = queue.enqueue(engine, "train", {"spec_version": 1, "run_id": "run-none"},
                            owner=box["admin"].id, max_attempts=1)
    t0 = time.monotonic()
    job = _ended(engine, s["id"])
    took = time.monotonic() - t0
    assert job.state == JobState.SUCCEEDED and job.result["ended"] == "yielded"
    assert job.result["for_job"] == waiting.id and took < GRACE + 4, took
    info = http.get(f"/api/playground/sessions/{s['id']}").json()
    assert info["status"] == "ended" and info["ended"] == "yielded"
    assert info["message"] == ("The session was ended to free the worker slot for a queued job; "
                               "the next message starts a new one.")
    ev = events.latest(engine, s["id"], "session")
    assert ev.data["status"] == "ended" and ev.data["for_job"] == waiting.id
    # the waiting job was admitted onto the slot (it fails: its run does not exist)
    assert _ended(engine, waiting.id).started_at is not None
    # the next message starts a new session
    s2, sent2 = _chat(box)
    assert s2["id"] != s["id"] and s2["reused"] is False
    assert _answer(engine, s2["id"], sent2["request_id"])["text"]  # (the next tests reuse it)


def test_stopping_a_prompt_keeps_its_partial_answer_and_the_session(box):
    # (a prompt stopped before its session took it is skipped: see the /v1 disconnect test)
    engine, http = box["engine"], box["http"]
    s, sent = _chat(box, max_tokens=8192, temperature=1.0, seed=7)
    rid = sent["request_id"]
    wait(lambda: any(e.data["request_id"] == rid for e in events.since(
        engine, s["id"], 0, 10000, types=["token"])), 30, "the first token")
    assert http.post(f"/api/playground/sessions/{s['id']}/prompts/{rid}/stop").json()["stopped"]
    a = _answer(engine, s["id"], rid)
    streamed = "".join(e.data["text"] for e in events.since(engine, s["id"], 0, 10000,
                                                            types=["token"])
                       if e.data["request_id"] == rid)
    assert a["finish_reason"] == "stopped" and a["text"] and streamed == a["text"]
    assert 0 < a["usage"]["completion_tokens"] < 500
    # an ended answer is not stopped again; another user's session is a 404
    r = http.post(f"/api/playground/sessions/{s['id']}/prompts/{rid}/stop")
    assert r.status_code == 200 and r.json()["stopped"] is False
    r = http.post(f"/api/playground/sessions/{s['id']}/prompts/req-nope/stop")
    assert r.status_code == 404 and r.json()["error"]["param"] == "request_id"
    assert queue.get_job(engine, s["id"]).state == JobState.RUNNING  # the model stays loaded


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_the_page_stops_a_streaming_reply(box):
    from playwright.sync_api import expect

    with browser_page(box["base"]) as pg:
        pg.goto(f"{box['base']}/playground?model={MODEL}")
        expect(pg.locator("#pg-stop")).to_be_hidden()
        pg.fill("input[name=temperature]", "1")
        pg.fill("input[name=max_tokens]", "8192")
        pg.fill("#pg-prompt", PROMPT[0]["content"])
        pg.click("#pg-send")
        reply = pg.locator("#pg-log-base .pg-msg.assistant")
        expect(pg.locator("#pg-stop")).to_be_visible()
        expect(reply).not_to_have_text("", timeout=60_000)  # tokens are streaming
        pg.click("#pg-stop")
        expect(reply).to_have_class("pg-msg assistant stopped")
        expect(reply.locator(".pg-stopped")).to_have_text(" (stopped)")
        expect(pg.locator("#pg-stop")).to_be_hidden()
        expect(pg.locator("#pg-send")).to_be_enabled()
        text = reply.text_content().removesuffix(" (stopped)")
        # a job queues for the slot: the idle session ends and the chat says why
        waiting = queue.enqueue(box["engine"], "train", {"spec_version": 1, "run_id": "run-none"},
                                owner=box["admin"].id, max_attempts=1)
        expect(pg.locator("#pg-log-base .pg-msg.note")).to_have_text(
            "The session was ended to free the worker slot for a queued job; the next message "
            "starts a new one.", timeout=15_000)
    sid = max(j.id for j in _sessions(box["engine"]))
    answers = [e.data for e in events.since(box["engine"], sid, 0, 10000, types=["answer"])]
    assert answers[-1]["finish_reason"] == "stopped" and answers[-1]["text"] == text
    _ended(box["engine"], waiting.id)


def test_a_disconnected_v1_caller_stops_waiting_and_its_retry_reuses_the_session(box):
    import openai

    engine, base = box["engine"], box["base"]
    from app.studio import playground as pg

    _stop_all(box)  # a new session starts: the callers wait while it loads
    before = {j.id for j in _sessions(engine)}
    headers = {"Authorization": f"Bearer {box['key']}"}
    body = {"model": MODEL, "messages": PROMPT, "temperature": 0, "max_tokens": 8}
    # 1. a non-streaming caller gives up while its new session starts (a worker child loads it;
    # a session still queued would leave the queue instead: the next test)
    sid = pg.open_session(engine, Settings(), box["admin"], MODEL)[0].id
    wait(lambda: queue.get_job(engine, sid).state == JobState.RUNNING, 30, "the session's claim")
    with httpx.Client(base_url=base, headers=headers, timeout=0.5) as quick, \
            pytest.raises(httpx.ReadTimeout):  # a long answer: not done in 0.5 s even if loaded
        quick.post("/v1/chat/completions", json={**body, "max_tokens": 8192, "temperature": 1})
    assert [j.id for j in _sessions(engine) if j.id not in before] == [sid]
    first = wait(lambda: _prompts(engine, sid), 5, "the first prompt")[0]
    # the server saw the disconnect: it stopped waiting and stopped the answer
    wait(lambda: first in _cancelled(engine, sid), 3, "the first prompt's cancel")
    # 2. a streaming caller closes its connection after the first chunk
    with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")
    second = wait(lambda: _prompts(engine, sid)[1:], 5, "the second prompt")[0]
    wait(lambda: second in _cancelled(engine, sid), 3, "the second prompt's cancel")
    # 3. the retry reuses the same session and is answered
    oc = openai.OpenAI(base_url=base + "/v1", api_key=box["key"], max_retries=0)
    out = oc.chat.completions.create(**body)
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    assert [j.id for j in _sessions(engine) if j.id not in before] == [sid]
    assert len(_prompts(engine, sid)) == 3
    answers = {e.data["request_id"]: e.data for e in events.since(engine, sid, 0, 10000,
                                                                   types=["answer"])}
    assert answers[first]["finish_reason"] == "stopped"  # never generated for nobody
    _stop_all(box)


def test_a_v1_caller_who_leaves_while_its_session_is_queued_takes_it_out_of_the_queue(box):
    """Nobody would read the answers: admitted later, the session would load the model and hold
    the slot for its idle time (trial finding). A queued session another prompt still waits on
    stays."""
    engine, base = box["engine"], box["base"]
    held = _hold_slot(box)
    try:
        headers = {"Authorization": f"Bearer {box['key']}"}
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 8}
        with httpx.Client(base_url=base, headers=headers, timeout=1.0) as quick, \
                pytest.raises(httpx.ReadTimeout):
            quick.post("/v1/chat/completions", json=body)
        sid = max(j.id for j in _sessions(engine))
        wait(lambda: queue.get_job(engine, sid).state == JobState.CANCELLED, 5,
             "the abandoned session to leave the queue")
        assert _prompts(engine, sid) and queue.get_job(engine, sid).started_at is None
        # two callers on one queued session: the first leaving keeps it for the second
        from app.studio import playground as pg

        s2 = pg.open_session(engine, Settings(), box["admin"], MODEL)[0]
        waiting = pg.send_prompt(engine, box["admin"], s2.id, {"messages": PROMPT})
        with httpx.Client(base_url=base, headers=headers, timeout=1.0) as quick, \
                pytest.raises(httpx.ReadTimeout):
            quick.post("/v1/chat/completions", json=body)
        assert len(_prompts(engine, s2.id)) == 2
        wait(lambda: len(_cancelled(engine, s2.id)) == 1, 5, "the leaver's prompt cancelled")
        assert waiting["request_id"] not in _cancelled(engine, s2.id)
        assert queue.get_job(engine, s2.id).state == JobState.QUEUED
    finally:
        _release(box, held)


def test_a_session_waiting_for_the_slot_is_listed_on_the_queue_and_opened_once(box):
    import threading

    from app.studio import playground as pg

    engine, http = box["engine"], box["http"]
    held = _hold_slot(box)
    # four concurrent opens (a client and its retries) make one session
    settings = Settings(playground_idle_seconds=120, playground_yield_seconds=GRACE)
    got, gate = [], threading.Barrier(4)

    def open_one():
        gate.wait()
        got.append(pg.open_session(engine, settings, box["admin"], MODEL))

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({j.id for j, _ in got}) == 1 and sorted(r for _, r in got) == [False] + [True] * 3
    sid = got[0][0].id
    q = http.get("/api/queue").json()
    row = next(w for w in q["waiting"] if w["job_id"] == sid)
    assert row["kind"] == "playground" and row["owner"] == ADMIN_USER
    assert row["reason"] == "behind 1 job: the CPU slot (no GPU) runs one job at a time"
    assert row["position"] == 1
    page = http.get("/queue").text
    assert f"job {sid}" in page and "behind 1 job: the CPU slot" in page
    time.sleep(0.5)
    assert queue.get_job(engine, sid).state == JobState.QUEUED  # the slot is busy
    _release(box, held)
    assert not any(w["job_id"] == sid for w in http.get("/api/queue").json()["waiting"])


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_signing_out_in_another_tab_ends_the_waiting_reply(box):
    from playwright.sync_api import expect

    held = _hold_slot(box)  # the reply waits: its session is queued
    with browser_page(box["base"]) as pg:
        pg.goto(f"{box['base']}/playground?model={MODEL}")
        pg.fill("#pg-prompt", PROMPT[0]["content"])
        pg.click("#pg-send")
        expect(pg.locator("#pg-status")).to_contain_text(
            "Waiting for a free slot: 1st in the queue")
        sign_out_elsewhere(pg)
        alert = pg.locator("#session-alert #signed-out")
        expect(alert).to_contain_text("You were signed out", timeout=15_000)
        assert alert.locator("a").get_attribute("href") == \
            f"/login?next=%2Fplayground%3Fmodel%3D{MODEL}"
        reply = pg.locator("#pg-log-base .pg-msg.assistant")
        expect(reply).to_have_text(" (not answered: you were signed out)")
        expect(reply).not_to_have_class("pending")
        expect(pg.locator("#pg-send")).to_be_enabled()
        # a prompt sent while signed out: not sent, the same message stays
        pg.fill("#pg-prompt", "again")
        pg.click("#pg-send")
        expect(pg.locator("#pg-log-base .pg-msg.assistant").nth(1)).to_have_text(
            " (not answered: you were signed out)")
        expect(pg.locator("#pg-error")).to_be_hidden()
        expect(alert).to_have_count(1)
    _release(box, held)


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_stop_while_waiting_for_the_slot_leaves_the_queue(box):
    """Stop pressed while the session still waits for its slot (a trial finding: the page stayed
    "Waiting…" until the slot freed, then loaded the model for nobody): the session leaves the
    queue at once, the reply says it was stopped, and the page takes the next prompt."""
    from playwright.sync_api import expect

    held = _hold_slot(box)
    with browser_page(box["base"]) as pg:
        pg.goto(f"{box['base']}/playground?model={MODEL}")
        pg.fill("#pg-prompt", PROMPT[0]["content"])
        pg.click("#pg-send")
        # where it waits, in the Queue page's words (its estimated start:
        # test_playground_wait.py, with a job that reports an ETA)
        expect(pg.locator("#pg-status")).to_contain_text(
            "Waiting for a free slot: 1st in the queue: behind 1 job: the CPU slot (no GPU) "
            "runs one job at a time")
        sid = max(j.id for j in _sessions(box["engine"]))
        pg.click("#pg-stop")
        reply = pg.locator("#pg-log-base .pg-msg.assistant")
        expect(reply).to_have_text(" (stopped before the model loaded)")
        expect(pg.locator("#pg-send")).to_be_enabled()
        expect(pg.locator("#pg-stop")).to_be_hidden()
        deadline = time.monotonic() + 10
        while queue.get_job(box["engine"], sid).state == JobState.QUEUED \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert queue.get_job(box["engine"], sid).state == JobState.CANCELLED
        expect(pg.locator("#pg-error")).to_be_hidden()
    _release(box, held)
