"""GRPO prompt uploads from the browser (trial s22 F9): a prompt in OpenAI ``messages`` is the
conversation up to its last user turn and the report says which rows leave turns out; an upload
that fails validation keeps the GRPO upload, not the SFT page."""
from __future__ import annotations

import html
import json
import re

from app.data.prompts import prompt_messages
from app.store import repo
from tests.web.conftest import run_validations

ENDS_ASSISTANT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
ENDS_USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


def _jsonl(*rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _upload(client, name: str, body: bytes, **fields) -> str:
    """POST the GRPO form's upload, validate it; the dataset's id."""
    r = client.post("/grpo/datasets", files={"file": (name, body)}, data=fields,
                    follow_redirects=False)
    assert r.status_code == 303, r.text[:2000]
    run_validations(client.app)
    return r.headers["location"].rsplit("/", 1)[1]


def _field_error(page: str, field: str) -> str | None:
    m = re.search(rf'id="upload_{field}_error" role="alert">([^<]*)<', page)
    return html.unescape(m.group(1)) if m else None


def test_messages_after_the_last_user_turn_are_left_out_and_said(client, engine):
    """Trial s22 F9 (a): a row whose messages end on the assistant's answer was taken as a
    prompt without a word. Its prompt is the conversation up to the last user turn (so a chat
    dataset serves as GRPO prompts; the model writes that reply), and the report now says how
    many rows leave turns out, naming the first; a row with no user turn at all is a row left
    out, naming its field; a file of only such rows fails naming the row and field."""
    no_user = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "yo"}]
    mixed = _upload(client, "mixed.jsonl", _jsonl({"messages": ENDS_USER, "answer": "4"},
                                                  {"messages": ENDS_ASSISTANT, "answer": "1"},
                                                  {"messages": no_user, "answer": "2"}))
    ds = repo.get_dataset(engine, mixed)
    assert ds.status == "processed" and ds.format == "prompts", ds.error
    assert ds.report["rows"] == 3 and ds.report["valid_rows"] == 2
    assert [(i["row"], i["field"]) for i in ds.report["invalid"]] == [(3, "messages")]
    assert "no user turn" in ds.report["invalid"][0]["message"]
    (warning,) = ds.report["warnings"]
    assert (warning["row"], warning["field"]) == (2, "messages[1]")
    assert warning["message"].startswith("1 row's messages go on after the last user turn "
                                         "(the first: row 2); each prompt is the conversation "
                                         "up to its last user turn")
    page = html.unescape(client.get(f"/datasets/{mixed}").text)
    assert warning["message"] in page and "Rows left out" in page
    # the worker builds its prompts with the same function
    assert prompt_messages(ENDS_ASSISTANT, "messages") == ENDS_ASSISTANT[:1]
    assert prompt_messages(ENDS_USER, "messages") == ENDS_USER
    assert prompt_messages(no_user, "messages") is None

    only = _upload(client, "no_user.jsonl", _jsonl({"messages": no_user}))
    ds = repo.get_dataset(engine, only)
    assert ds.status == "error"
    assert ds.error.startswith("row 1, field 'messages': the messages have no user turn"), ds.error


def test_failed_prompt_upload_offers_the_grpo_upload_again(client, engine):
    """Rows without a prompt column: the dataset's page is the prompt dataset's (no SFT
    controls), with the GRPO upload again and the message at prompt_column; a missing
    answer_column shows at answer_column with the columns asked for kept."""
    ds_id = _upload(client, "nocol.jsonl", _jsonl({"foo": 1}, {"foo": 2}))
    ds = repo.get_dataset(engine, ds_id)
    assert ds.status == "error" and ds.purpose == "grpo"
    page = client.get(f"/datasets/{ds_id}").text
    assert 'action="/grpo/datasets"' in page and 'name="prompt_column"' in page \
        and 'name="answer_column"' in page
    err = _field_error(page, "prompt_column") or ""
    assert err.startswith("no prompt column found (looked for prompt, question")
    assert err.endswith("; name it with prompt_column (columns: foo)")
    assert _field_error(page, "answer_column") is None
    assert 'href="/runs/new/grpo"' in page
    for sft_only in ("Train on this dataset", "max_seq_length", 'name="chat_template"',
                     'name="model"', "/runs/new?dataset=", "Map the columns"):
        assert sft_only not in page, sft_only
    assert client.get(f"/datasets/{ds_id}/report").text.count('action="/grpo/datasets"') == 1

    ds_id = _upload(client, "q.jsonl", _jsonl({"task": "2+2?", "gold": "4"}),
                    prompt_column="task", answer_column="answer")
    page = client.get(f"/datasets/{ds_id}").text
    assert "no reference column 'answer'" in (_field_error(page, "answer_column") or "")
    assert _field_error(page, "prompt_column") is None
    assert 'name="prompt_column" value="task"' in page
    assert 'name="answer_column" value="answer"' in page
