"""The playground end to end on the CPU: a real upload, the demo model's import and a 6-step
stories260K run through the real worker loop, then a real ``playground`` worker (its own claim
loop in a thread) serving sessions to the web app on a real uvicorn: the page API, its SSE, and
``/v1/chat/completions`` through the official ``openai`` client.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.settings import Settings
from app.store import events, queue, repo
from app.store.db import reset_engines
from app.store.schema import JobState
from tests.conftest import SHARED_DATA, STORIES
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, served, signed_in, upload_and_import
from tests.web.test_web_browser import CHROMIUM, browser_page

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(),
                                reason=f"no test data at {SHARED_DATA}")

IDLE = 3.0  # seconds a session waits for a prompt before it ends
PROMPT = [{"role": "user", "content": "Who are you?"}]
GREEDY = {"temperature": 0, "max_tokens": 16}


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    from app.studio import accounts
    from app.web.main import create_app
    from worker.loop import Worker

    d = tmp_path_factory.mktemp("playground")
    settings = Settings(data_dir=d / "data", seed_dir=SHARED_DATA, max_upload_mb=8,
                        admin_user=ADMIN_USER, admin_password=ADMIN_PASSWORD,
                        heartbeat_seconds=0.5, playground_idle_seconds=IDLE)
    app = create_app(settings)
    with signed_in(app) as client:
        w = Worker(settings, worker_id="w-train", kinds=["import_model", "train", "export"],
                   poll_interval=0.05)
        w.start()
        dataset = upload_and_import(client, w, SHARED_DATA / "sft" / "identity_alpaca.json")
        r = client.post("/api/runs", json={
            "model": "stories260K", "dataset": dataset, "max_steps": 6, "save_steps": 3,
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
            "learning_rate": 1e-2, "r": 8, "lora_alpha": 16, "warmup_ratio": 0.0,
            "max_seq_length": 128, "chat_template": "chatml"})
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        w.serve(once=True)
        run, job = repo.run_with_job(w.engine, run_id)
        assert job.state == JobState.SUCCEEDED, job.error
        play = Worker(settings, worker_id="w-play", kinds=["playground"], poll_interval=0.05)
        play.engine = w.engine
        th = threading.Thread(target=play.serve, daemon=True)
        th.start()
        stack = contextlib.ExitStack()
        base = stack.enter_context(served(app))
        admin = accounts.authenticate(w.engine, ADMIN_USER, ADMIN_PASSWORD)
        key = accounts.create_api_key(w.engine, admin, "tests")[1]
        http = httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {key}"})
        yield {"client": client, "engine": w.engine, "worker": w, "run": run, "base": base, "key": key,
               "http": http, "model": f"stories260K:ft:{run.id}"}
        http.close()
        stack.close()
        play.shutdown.set()
        th.join(timeout=30)
        w.stop()
    reset_engines()


def _answers(engine, session: int, rid: str, sides: list[str], timeout: float = 60.0
             ) -> tuple[dict[str, dict], dict[str, str], float | None]:
    """(answer per side, the streamed token text per side, seconds to the first token event)."""
    t0, first = time.monotonic(), None
    answers: dict[str, dict] = {}
    streamed = {s: "" for s in sides}
    after = 0
    while len(answers) < len(sides):
        assert time.monotonic() - t0 < timeout, f"no answer in {timeout}s: {answers}"
        for ev in events.since(engine, session, after, types=["token", "answer"]):
            after = ev.id
            if ev.data.get("request_id") != rid:
                continue
            if ev.type == "token":
                first = first if first is not None else time.monotonic() - t0
                streamed[ev.data["side"]] += ev.data["text"]
            else:
                answers[ev.data["side"]] = ev.data
        time.sleep(0.02)
    return answers, streamed, first


def _ask(studio, messages=PROMPT, **params):
    """Open (or reuse) the admin's session on the run's model and send ``messages``."""
    http = studio["http"]
    r = http.post("/api/playground/sessions", json={"model": studio["model"]})
    assert r.status_code in (200, 201), r.text
    s = r.json()
    r = http.post(f"/api/playground/sessions/{s['id']}/prompts",
                  json={"messages": messages, **GREEDY, **params})
    assert r.status_code == 202, r.text
    return s, r.json()


def _greedy(studio) -> dict[str, str]:
    """The greedy answers to PROMPT per side (the first test records them; else asked now)."""
    if "greedy" not in studio:
        s, sent = _ask(studio)
        answers = _answers(studio["engine"], s["id"], sent["request_id"], s["sides"])[0]
        studio["greedy"] = {side: a["text"] for side, a in answers.items()}
    return studio["greedy"]


def test_fine_tuned_and_base_stream_different_tokens_and_the_model_stays_loaded(studio):
    engine = studio["engine"]
    s, sent = _ask(studio)
    assert s["sides"] == ["fine_tuned", "base"] and s["template_name"] == "chatml"
    assert s["estimate_gib"] and s["estimate_gib"] > 0
    answers, streamed, _ = _answers(engine, s["id"], sent["request_id"], s["sides"])
    for side in s["sides"]:
        a = answers[side]
        assert a["text"] and streamed[side] == a["text"]  # the tokens add up to the answer
        assert "<|im" not in streamed[side]  # chatml's end of turn is cut, never streamed
        assert a["usage"]["completion_tokens"] > 0 and a["usage"]["prompt_tokens"] > 5
        assert a["loads"] == 1
    assert answers["fine_tuned"]["text"] != answers["base"]["text"]
    studio["greedy"] = {side: answers[side]["text"] for side in s["sides"]}

    # a second prompt: same session, no second load, first token within 2 s
    again, sent2 = _ask(studio, PROMPT + [{"role": "assistant", "content": "I am a bot."},
                                          {"role": "user", "content": "hi"}])
    assert again["id"] == s["id"] and again["reused"] is True and again["status"] == "ready"
    answers2, _, first = _answers(engine, s["id"], sent2["request_id"], s["sides"])
    assert first is not None and first < 2.0, first
    assert all(a["loads"] == 1 for a in answers2.values())
    loaded = [e for e in events.since(engine, s["id"], types=["session"])]
    assert len(loaded) == 1 and loaded[0].data["loads"] == 1
    assert queue.get_job(engine, s["id"]).state == JobState.RUNNING


def test_session_events_stream_over_sse(studio):
    s, sent = _ask(studio)
    seen: dict[str, str] = {}
    done: set[str] = set()
    url = f"/api/playground/sessions/{s['id']}/events?after={sent['after'] - 1}"
    with studio["http"].stream("GET", url, timeout=60) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind in ("token", "answer", "prompt"):
                d = json.loads(line[6:])
                assert d["request_id"] == sent["request_id"]
                if kind == "token":
                    seen[d["side"]] = seen.get(d["side"], "") + d["text"]
                elif kind == "answer":
                    done.add(d["side"])
                    assert seen[d["side"]] == d["text"]
                if done == {"fine_tuned", "base"}:
                    break
    assert done == {"fine_tuned", "base"}


def test_openai_client_streaming_and_not(studio):
    import openai

    c = openai.OpenAI(base_url=studio["base"] + "/v1", api_key=studio["key"], max_retries=0)
    assert any(m.id == studio["model"] for m in c.models.list().data)
    out = c.chat.completions.create(model=studio["model"], messages=PROMPT, **GREEDY)
    assert out.object == "chat.completion" and out.model == studio["model"]
    text = out.choices[0].message.content
    assert text == _greedy(studio)["fine_tuned"]  # greedy: the page's fine-tuned answer
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    chunks = list(c.chat.completions.create(model=studio["model"], messages=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] \
        == out.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens \
        == out.usage.completion_tokens
    # the base model by its own id: its own session, the base side's greedy answer
    base = c.chat.completions.create(model="stories260K", messages=PROMPT, **GREEDY)
    assert base.choices[0].message.content == _greedy(studio)["base"]

    for bad, param in (({"temperature": -1}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
                       ({"top_p": 0}, "top_p"), ({"messages": []}, "messages")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(**{"model": studio["model"], "messages": PROMPT, **bad})
        assert e.value.body["param"] == param and param in e.value.body["message"] or \
            e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:  # longer than stories260K's 512 tokens
        c.chat.completions.create(model=studio["model"], messages=[
            {"role": "user", "content": "Once upon a time " * 200}], **GREEDY)
    assert e.value.body["param"] == "messages" and "context (512)" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="stories260K:ft:ftjob-0000000000000000",
                                  messages=PROMPT)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_top_k_and_min_p_reach_the_worker_from_every_surface(studio):
    """top_k=1 or min_p near 1 at temperature 1 samples the argmax: the greedy answers, on both
    panes through /api and through /v1 as vLLM's extra body fields."""
    import openai

    greedy = _greedy(studio)
    for extra in ({"top_k": 1}, {"min_p": 0.999}):
        s, sent = _ask(studio, temperature=1, seed=5, **extra)
        answers = _answers(studio["engine"], s["id"], sent["request_id"], s["sides"])[0]
        assert {side: a["text"] for side, a in answers.items()} == greedy, extra
    c = openai.OpenAI(base_url=studio["base"] + "/v1", api_key=studio["key"], max_retries=0)
    out = c.chat.completions.create(model=studio["model"], messages=PROMPT, temperature=1,
                                    seed=5, max_tokens=GREEDY["max_tokens"],
                                    extra_body={"top_k": 1, "repetition_penalty": 1.0})
    assert out.choices[0].message.content == greedy["fine_tuned"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=studio["model"], messages=PROMPT,
                                  extra_body={"repetition_penalty": 0})
    assert e.value.body["param"] == "repetition_penalty"


def test_another_user_gets_404(studio):
    http = studio["http"]
    s, _ = _ask(studio)
    r = http.post("/api/users", json={"name": "bea", "password": "bea-password-1",
                                      "role": "member"})
    assert r.status_code == 201, r.text
    tok = httpx.post(studio["base"] + "/api/login/access-token",
                     data={"username": "bea", "password": "bea-password-1"}).json()
    bea = httpx.Client(base_url=studio["base"], timeout=30,
                       headers={"Authorization": f"Bearer {tok['access_token']}"})
    with bea:
        for method, url in (("GET", f"/api/playground/sessions/{s['id']}"),
                            ("POST", f"/api/playground/sessions/{s['id']}/prompts"),
                            ("POST", f"/api/playground/sessions/{s['id']}/stop"),
                            ("GET", f"/api/playground/sessions/{s['id']}/events")):
            r = bea.request(method, url, json={"messages": PROMPT} if method == "POST" else None)
            assert r.status_code == 404, (url, r.text)
        for path in ("/api/playground/sessions", "/v1/chat/completions"):
            r = bea.post(path, json={"model": studio["model"], "messages": PROMPT})
            assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        assert studio["run"].id not in bea.get("/playground").text
    job = queue.get_job(studio["engine"], s["id"])  # B's attempts left it alone
    assert job.state in (JobState.QUEUED, JobState.RUNNING) and not job.cancel_requested


def test_bad_prompt_parameters_name_their_field(studio):
    http = studio["http"]
    s, _ = _ask(studio)
    url = f"/api/playground/sessions/{s['id']}/prompts"
    for body, field in (({"temperature": -0.5}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
                        ({"top_p": 1.5}, "top_p"), ({"messages": []}, "messages"),
                        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
                        ({"messages_by_side": {"gguf": PROMPT}}, "messages_by_side")):
        r = http.post(url, json={"messages": PROMPT, **body})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == field, r.text
    r = http.post("/api/playground/sessions", json={"model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def _playground_jobs(engine) -> int:
    from sqlmodel import func, select

    from app.store.db import session_scope
    from app.store.schema import Job

    with session_scope(engine) as s:
        return s.exec(select(func.count()).select_from(Job).where(Job.kind == "playground")).one()


def test_bad_prompt_parameters_queue_no_session(studio):
    """The page opens its session with the prompt's parameters: a bad one is refused before
    any session is queued, as /v1 refuses it."""
    engine, http = studio["engine"], studio["http"]
    model = f"{studio['model']}:checkpoint-3"
    before = _playground_jobs(engine)
    for path, body, status in (
            ("/api/playground/sessions", {"model": model, "temperature": 7}, 422),
            ("/api/playground/sessions", {"model": model, "max_tokens": 0.5}, 422),
            ("/v1/chat/completions", {"model": model, "messages": PROMPT, "temperature": 7}, 400)):
        r = http.post(path, json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == next(k for k in body if k not in
                                                  ("model", "messages")), r.text
    assert _playground_jobs(engine) == before


def test_a_pruned_checkpoint_is_not_offered_nor_accepted(studio):
    """A checkpoint recorded but pruned from disk: not in the picker; 404 listing those on disk."""
    from app.store.schema import Artifact

    c, engine, http, run = studio["client"], studio["engine"], studio["http"], studio["run"]
    gone = Path(run.output_dir or "/nonexistent") / "checkpoints" / "checkpoint-4"
    repo.add_artifact(engine, Artifact(run_id=run.id, kind="checkpoint", name="checkpoint-4",
                                       path=str(gone), meta={"step": 4}))
    page = c.get("/playground", params={"model": studio["model"]}).text
    assert f'value="{studio["model"]}:checkpoint-3"' in page
    assert f'{studio["model"]}:checkpoint-4' not in page
    before = _playground_jobs(engine)
    for path, body in (("/api/playground/sessions", {"model": f"{studio['model']}:checkpoint-4"}),
                       ("/v1/chat/completions", {"model": f"{studio['model']}:ckpt-step-4",
                                                 "messages": PROMPT})):
        r = http.post(path, json=body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == "model_not_found", err
        assert "no checkpoint at step 4 on disk: " in err["message"], err
        assert err["message"].endswith("(checkpoints on disk: 6, 3)"), err
    assert _playground_jobs(engine) == before


def test_the_checkpoint_ids_of_the_openai_api_chat(studio):
    """``…:ckpt-step-N`` (GET /v1/fine_tuning/jobs/{id}/checkpoints) is ``…:checkpoint-N``."""
    http, run = studio["http"], studio["run"]
    listed = http.get(f"/v1/fine_tuning/jobs/{run.id}/checkpoints").json()["data"]
    ids = {c["step_number"]: c["fine_tuned_model_checkpoint"] for c in listed}
    assert ids[3] == f"{studio['model']}:ckpt-step-3", ids
    r = http.post("/v1/chat/completions", json={"model": ids[3], "messages": PROMPT, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == f"{studio['model']}:checkpoint-3"
    assert r.json()["usage"]["completion_tokens"] > 0
    r = http.post("/api/playground/sessions", json={"model": ids[3]})
    assert r.status_code == 200 and r.json()["reused"] is True  # the same session
    assert r.json()["checkpoint_step"] == 3
    http.post(f"/api/playground/sessions/{r.json()['id']}/stop")


def test_the_session_ends_after_its_idle_time(studio):
    engine, http = studio["engine"], studio["http"]
    s, sent = _ask(studio)
    _answers(engine, s["id"], sent["request_id"], s["sides"])
    deadline = time.monotonic() + IDLE + 15
    while queue.get_job(engine, s["id"]).state == JobState.RUNNING:
        assert time.monotonic() < deadline, "the idle session did not end"
        time.sleep(0.1)
    job = queue.get_job(engine, s["id"])
    assert job.state == JobState.SUCCEEDED and job.result["ended"] == "idle"
    assert job.result["prompts"] >= 1 and job.result["loads"] == 1
    assert http.get(f"/api/playground/sessions/{s['id']}").json()["status"] == "ended"
    r = http.post(f"/api/playground/sessions/{s['id']}/prompts", json={"messages": PROMPT})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_ended"
    r = http.post("/api/playground/sessions", json={"model": studio["model"]})
    assert r.status_code == 201 and r.json()["id"] != s["id"] and r.json()["reused"] is False
    # stopped: it ends at once (queued) or at the worker's next check (running)
    assert http.post(f"/api/playground/sessions/{r.json()['id']}/stop").status_code == 200
    deadline = time.monotonic() + 15
    while queue.get_job(engine, r.json()["id"]).state not in JobState.FINAL:
        assert time.monotonic() < deadline, "the stopped session did not end"
        time.sleep(0.1)
    assert queue.get_job(engine, r.json()["id"]).state == JobState.CANCELLED


def test_page_and_checkpoints(studio):
    c, run = studio["client"], studio["run"]
    page = c.get(f"/runs/{run.id}").text
    assert f'href="/playground?model=stories260K%3Aft%3A{run.id}"' in page
    page = c.get("/playground", params={"model": f"{studio['model']}:checkpoint-3"}).text
    assert 'id="playground"' in page and 'data-sides="fine_tuned,base"' in page
    assert '<a href="/playground" class="active">Playground</a>' in page
    assert 'id="pg-template-name">chatml<' in page and "checkpoint 3" in page
    assert f'value="{studio["model"]}:checkpoint-6"' in page
    r = c.get("/playground", params={"model": f"{studio['model']}:checkpoint-7"})
    assert r.status_code == 404


def test_an_exported_gguf_through_llama_cpp(studio):
    import openai

    c, engine, run = studio["client"], studio["engine"], studio["run"]
    r = c.post(f"/api/runs/{run.id}/exports", json={"format": "gguf", "quantization": "F32"})
    assert r.status_code == 201, r.text
    studio["worker"].serve(once=True)
    info = c.get(f"/api/exports/{r.json()['id']}").json()
    assert info["status"] == "succeeded", info
    art = repo.list_artifacts(engine, run.id, kind="gguf")[0]
    model = f"{studio['model']}:{art.id}"
    page = c.get("/playground", params={"model": model}).text
    assert 'data-sides="gguf"' in page and "through llama.cpp" in page
    oc = openai.OpenAI(base_url=studio["base"] + "/v1", api_key=studio["key"], max_retries=0)
    out = oc.chat.completions.create(model=model, messages=PROMPT, **GREEDY)
    text = out.choices[0].message.content
    assert text and out.usage.completion_tokens > 0
    # the merged F32 weights in llama.cpp answer as the adapter does in transformers
    assert text == _greedy(studio)["fine_tuned"], (text, _greedy(studio))
    # vLLM's extra body fields reach llama.cpp: top_k=1 (min_p near 1) at temperature 1 is greedy
    for extra in ({"top_k": 1}, {"min_p": 0.999}):
        out = oc.chat.completions.create(model=model, messages=PROMPT, temperature=1, seed=3,
                                         max_tokens=GREEDY["max_tokens"], extra_body=extra)
        assert out.choices[0].message.content == text, extra
    chunks = list(oc.chat.completions.create(model=model, messages=PROMPT, stream=True,
                                             **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    # its export cannot be deleted while a session serves it; once stopped, it can
    export_id = r.json()["id"]
    s = studio["http"].post("/api/playground/sessions", json={"model": model}).json()
    r = c.delete(f"/api/exports/{export_id}")
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "export_in_use"
    assert f"playground session {s['id']}" in r.json()["error"]["message"]
    assert art.path and Path(art.path).is_file()
    studio["http"].post(f"/api/playground/sessions/{s['id']}/stop")
    deadline = time.monotonic() + 15
    while queue.get_job(engine, s["id"]).state not in JobState.FINAL:
        assert time.monotonic() < deadline, "the stopped session did not end"
        time.sleep(0.1)
    assert c.delete(f"/api/exports/{export_id}").status_code == 200
    assert not Path(art.path).exists()


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_the_page_opened_from_a_run_fills_both_panes(studio):
    from playwright.sync_api import expect

    run, greedy = studio["run"], _greedy(studio)
    with browser_page(studio["base"]) as pg:
        pg.goto(f"{studio['base']}/runs/{run.id}")
        pg.click("#open-playground")
        pg.wait_for_selector("#playground")
        expect(pg.locator("#pg-template-name")).to_have_text("chatml")
        pg.fill("input[name=temperature]", "0")
        pg.fill("input[name=max_tokens]", str(GREEDY["max_tokens"]))
        pg.fill("#pg-prompt", PROMPT[0]["content"])
        pg.click("#pg-send")
        for side in ("fine_tuned", "base"):
            done = pg.locator(f"#pg-log-{side} .pg-msg.assistant:not(.pending)")
            expect(done).to_have_count(1, timeout=60_000)
            assert done.text_content() == greedy[side]  # the greedy answers
            expect(pg.locator(f"#pg-stats-{side}")).to_contain_text("tokens/s")
        expect(pg.locator("#pg-log-base .pg-msg.user")).to_have_text(PROMPT[0]["content"])
        expect(pg.locator("#pg-send")).to_be_enabled()


def test_a_possible_end_of_turn_is_held_back_until_it_is_known():
    from worker.engine.chat import _held_back

    assert [_held_back(t) for t in ("Hello", "Hello <", "Hello <|im", "Hello <|im_end", "a</")] \
        == [0, 1, 4, 8, 2]
