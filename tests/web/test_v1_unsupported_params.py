"""/v1/chat/completions refuses the OpenAI parameters its models do not honour (trial s23 L-6:
``logprobs: true`` answered 200 with ``logprobs: null`` and ``tools`` were ignored), naming the
parameter, before any playground session is queued; their default values are taken."""
from __future__ import annotations

import json

from sqlmodel import func, select

from app.store import repo
from app.store.db import session_scope
from app.store.schema import Job

MSGS = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _sessions(engine) -> int:
    with session_scope(engine) as s:
        return s.exec(select(func.count()).select_from(Job).where(Job.kind == "playground")).one()


def test_unsupported_parameters_are_a_400_naming_them(client, engine):
    repo.update_model(engine, "model-stories260K", status="ready")
    for extra, param in (({"logprobs": True}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
                         ({"tools": [TOOL]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
                         ({"functions": [TOOL["function"]]}, "functions"),
                         ({"logit_bias": {"50256": -100}}, "logit_bias"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"response_format": "text"}, "response_format"),
                         ({"stop": ["\n\n"]}, "stop"), ({"presence_penalty": 0.5}, "presence_penalty"),
                         ({"frequency_penalty": -1}, "frequency_penalty")):
        r = client.post("/v1/chat/completions", json={"model": "stories260K", "messages": MSGS,
                                                      **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "not supported here; leave" in err["message"], err
        assert " is not supported" in err["message"] or " are not supported" in err["message"]
    assert _sessions(engine) == 0
    # the defaults a client may send are no refusal: the request goes on to open a session
    r = client.post("/v1/chat/completions", json={
        "model": "stories260K", "messages": MSGS, "logprobs": False, "tools": [],
        "tool_choice": "none", "response_format": {"type": "text"}, "stop": None,
        "presence_penalty": 0, "frequency_penalty": 0.0, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_a_lone_surrogate_in_a_message_is_a_400_naming_it_before_any_session(client, engine):
    """Trial s24 H-1: ``"hi\\ud800there"`` reached the tokenizer, which raised a TypeError: the
    session failed (twice, each loading the model) and the client got a 503 quoting it."""
    repo.update_model(engine, "model-stories260K", status="ready")
    for msgs, param in (([{"role": "user", "content": "hi\ud800there"}], "messages[0].content"),
                        ([{"role": "system", "content": "be \udfff"}, *MSGS], "messages[0].content"),
                        ([{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}],
                         "messages[0].content")):
        body = json.dumps({"model": "stories260K", "messages": msgs})  # ASCII: "\ud800" escapes
        r = client.post("/v1/chat/completions", content=body,
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param, err
        assert "unpaired UTF-16 surrogate (\\u" in err["message"] and "not text" in err["message"]
    assert _sessions(engine) == 0
    # a real pair (an emoji) is text
    r = client.post("/v1/chat/completions", json={"model": "stories260K", "messages": [
        {"role": "user", "content": "hi \U0001f600"}], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
