"""Playground sampling options that are not numbers, or not ones the playground applies, are
refused naming the field, before any session is queued; the page says which field and sends
nothing (a field the browser cannot read as a number used to go out as null, and the default
was used unseen)."""
from __future__ import annotations

import pytest
from sqlmodel import func, select

from app.store import repo
from app.store.db import session_scope
from app.store.schema import Job
from tests.web.test_web_browser import CHROMIUM, browser_page

DEMO = "model-stories260K"


def _sessions(engine) -> int:
    with session_scope(engine) as s:
        return s.exec(select(func.count()).select_from(Job).where(Job.kind == "playground")).one()


def test_bad_sampling_values_are_refused_naming_the_field(client, engine):
    repo.update_model(engine, DEMO, status="ready")
    for body, field, words in (
            ({"top_p": "abc"}, "top_p", "must be a number, not 'abc'"),
            ({"temperature": "hot"}, "temperature", "must be a number, not 'hot'"),
            ({"max_tokens": "many"}, "max_tokens", "must be a number, not 'many'"),
            ({"top_p": 0}, "top_p", "must be greater than 0 and at most 1, not 0"),
            ({"temperature": 9}, "temperature", "must be at least 0 and at most 2, not 9"),
            ({"max_tokens": 2.5}, "max_tokens", "must be a whole number, not 2.5"),
            ({"top_k": 40}, "top_k", "does not apply this option"),
            ({"min_p": "abc"}, "min_p", "does not apply this option"),
            ({"repetition_penalty": 1.1}, "repetition_penalty", "does not apply this option")):
        r = client.post("/api/playground/sessions", json={"model": "stories260K", **body})
        assert r.status_code == 422, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and words in err["message"], (body, err)
    assert _sessions(engine) == 0


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
