"""Playground sampling options that are not numbers or out of range (temperature, top_p,
max_tokens, top_k, min_p, repetition_penalty) are refused naming the field on every surface,
before any session is queued; the page says which field and sends nothing (a field the
browser cannot read as a number used to go out as null, and the default was used unseen)."""
from __future__ import annotations

import pytest
from sqlmodel import func, select

from app.store import events, repo
from app.store.db import session_scope
from app.store.schema import Job
from tests.web.test_web_browser import CHROMIUM, browser_page

DEMO = "model-stories260K"


def _only_session(engine) -> int:
    with session_scope(engine) as s:
        return s.exec(select(Job.id).where(Job.kind == "playground")).one()


def _sessions(engine) -> int:
    with session_scope(engine) as s:
        return s.exec(select(func.count()).select_from(Job).where(Job.kind == "playground")).one()


#: (body, field, words of the message): every sampling field's bad values.
BAD = (({"top_p": "abc"}, "top_p", "must be a number, not 'abc'"),
       ({"temperature": "hot"}, "temperature", "must be a number, not 'hot'"),
       ({"max_tokens": "many"}, "max_tokens", "must be a number, not 'many'"),
       ({"top_p": 0}, "top_p", "must be greater than 0 and at most 1, not 0"),
       ({"temperature": 9}, "temperature", "must be at least 0 and at most 2, not 9"),
       ({"max_tokens": 2.5}, "max_tokens", "must be a whole number, not 2.5"),
       ({"top_k": -1}, "top_k", "must be at least 0 and at most 1000000, not -1"),
       ({"top_k": 2.5}, "top_k", "must be a whole number, not 2.5"),
       ({"top_k": "many"}, "top_k", "must be a number, not 'many'"),
       ({"top_k": 10**7}, "top_k", "at most 1000000, not 10000000"),
       ({"min_p": "abc"}, "min_p", "must be a number, not 'abc'"),
       ({"min_p": 1}, "min_p", "must be at least 0 and less than 1, not 1"),
       ({"min_p": -0.1}, "min_p", "must be at least 0 and less than 1, not -0.1"),
       ({"repetition_penalty": 0}, "repetition_penalty",
        "must be greater than 0 and at most 10, not 0"),
       ({"repetition_penalty": 10.5}, "repetition_penalty",
        "must be greater than 0 and at most 10, not 10.5"),
       ({"repetition_penalty": True}, "repetition_penalty", "must be a number, not True"))
#: (body, the params a prompt event carries): good values; an "off" value is left out.
GOOD = (({"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3},
         {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3}),
        ({"top_k": 0, "min_p": 0, "repetition_penalty": 1}, {}),
        ({"top_k": 1.0, "min_p": 0.99, "repetition_penalty": 10}, {"top_k": 1, "min_p": 0.99,
                                                                   "repetition_penalty": 10.0}),
        ({"top_k": "5", "repetition_penalty": 0.5}, {"top_k": 5, "repetition_penalty": 0.5}))


def test_bad_sampling_values_are_refused_naming_the_field(client, engine):
    repo.update_model(engine, DEMO, status="ready")
    for path, status in (("/api/playground/sessions", 422), ("/v1/chat/completions", 400)):
        for body, field, words in BAD:
            r = client.post(path, json={"model": "stories260K", "messages": [
                {"role": "user", "content": "Hi"}], **body})
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert err["param"] == field and words in err["message"], (path, body, err)
    assert _sessions(engine) == 0
    # a prompt to a session (queued: no worker here) is checked the same way
    r = client.post("/api/playground/sessions", json={"model": "stories260K"})
    assert r.status_code == 201, r.text
    url = f"/api/playground/sessions/{r.json()['id']}/prompts"
    for body, field, words in BAD:
        r = client.post(url, json={"messages": [{"role": "user", "content": "Hi"}], **body})
        assert r.status_code == 422, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and words in err["message"], (body, err)


def test_top_k_min_p_repetition_penalty_reach_the_prompt_event(client, engine):
    """Good values open a session and are stored on the prompt the worker answers (the worker
    side: tests/worker/test_playground_sampling.py)."""
    repo.update_model(engine, DEMO, status="ready")
    for body, stored in GOOD:
        r = client.post("/api/playground/sessions", json={"model": "stories260K", **body})
        assert r.status_code in (200, 201), (body, r.text)
        sid = r.json()["id"]
        r = client.post(f"/api/playground/sessions/{sid}/prompts", json={
            "messages": [{"role": "user", "content": "Hi"}], "temperature": 1, **body})
        assert r.status_code == 202, (body, r.text)
        ev = events.latest(engine, sid, "prompt")
        assert ev.data["params"] == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 256,
                                     **stored}, body
    assert _sessions(engine) == 1  # one session for the model, reused


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_the_page_names_an_unreadable_field_and_sends_nothing(server, client, engine):
    repo.update_model(engine, DEMO, status="ready")
    with browser_page(server) as page:
        sent: list[str] = []
        page.on("request", lambda r: sent.append(r.url) if "/api/playground" in r.url else None)
        page.goto(f"{page.base}/playground?model=stories260K")
        # a number input given text it cannot read holds "" (the page used to send null)
        page.eval_on_selector("input[name=top_p]", "el => { el.value = 'abc'; }")
        page.fill("#pg-prompt", "Once upon a time")
        page.click("#pg-send")
        page.wait_for_selector("#pg-error:not([hidden])")
        assert page.text_content("#pg-error") == "top_p: must be a number"
        assert page.get_attribute("input[name=top_p]", "aria-invalid") == "true"
        assert page.evaluate("document.activeElement.name") == "top_p"
        assert page.input_value("#pg-prompt") == "Once upon a time"  # kept to send again
        assert not page.query_selector(".pg-msg")  # no bubble: nothing was asked
        assert sent == [] and _sessions(engine) == 0
        # the new sampler fields are checked the same way
        page.fill("input[name=top_p]", "1")
        page.eval_on_selector("input[name=top_k]", "el => { el.value = 'abc'; }")
        page.click("#pg-send")
        page.wait_for_function(
            "document.querySelector('#pg-error').textContent.startsWith('top_k')")
        assert page.text_content("#pg-error") == "top_k: must be a number"
        assert page.get_attribute("input[name=top_p]", "aria-invalid") is None
        assert page.get_attribute("input[name=top_k]", "aria-invalid") == "true"
        assert sent == [] and _sessions(engine) == 0
        # good values go out on the session and on the prompt (ranges: the inputs' min/max,
        # then the server, as the table above)
        page.fill("input[name=top_k]", "40")
        bodies: list[dict] = []
        page.on("request", lambda r: bodies.append(r.post_data_json)
                if r.method == "POST" and "/api/playground/sessions" in r.url else None)
        page.fill("input[name=min_p]", "0.05")
        page.fill("input[name=repetition_penalty]", "1.3")
        page.fill("#pg-prompt", "Once upon a time")
        # the prompt's POST answered: its event is written (the status line can show the
        # session waiting while the prompt is still on its way)
        with page.expect_response(lambda r: r.request.method == "POST"
                                  and r.url.endswith("/prompts")) as answer:
            page.click("#pg-send")
        assert answer.value.status == 202, answer.value.text()
        page.wait_for_function("document.querySelector('#pg-status').textContent"
                               ".includes('Waiting for a free slot')")
        want = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3}
        assert len(bodies) == 2 and all(
            {k: b[k] for k in want} == want for b in bodies), bodies
        ev = events.latest(engine, _only_session(engine), "prompt")
        assert {k: ev.data["params"][k] for k in want} == want
