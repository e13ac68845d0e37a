"""GRPO prompt uploads from the browser (trial s22 F9): prompts in OpenAI ``messages`` must end on
a user turn, and an upload that fails validation keeps the GRPO upload, not the SFT page."""
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


def test_messages_ending_on_an_assistant_turn_are_invalid_rows(client, engine):
    """A row whose messages end on an assistant turn is an invalid row naming the row and the
    field (the model would write a second reply); the job reads the same rule (no prompt);
    a file of only such rows fails validation with that message."""
    mixed = _upload(client, "mixed.jsonl", _jsonl({"messages": ENDS_USER, "answer": "4"},
                                                  {"messages": ENDS_ASSISTANT, "answer": "1"}))
    ds = repo.get_dataset(engine, mixed)
    assert ds.status == "processed" and ds.format == "prompts", ds.error
    assert ds.report["rows"] == 2 and ds.report["valid_rows"] == 1
    assert [(i["row"], i["field"]) for i in ds.report["invalid"]] == [(2, "messages[1].role")]
    assert "ends on an assistant turn" in ds.report["invalid"][0]["message"]
    page = html.unescape(client.get(f"/datasets/{mixed}").text)
    assert "Rows left out" in page and "messages[1].role" in page
    assert "assistant: yo" not in page  # not among the example prompts
    # the worker builds its prompts with the same function: no prompt for that row
    assert prompt_messages(ENDS_ASSISTANT, "messages") is None
    assert prompt_messages(ENDS_USER, "messages") == ENDS_USER

    only = _upload(client, "ends_assistant.jsonl", _jsonl({"messages": ENDS_ASSISTANT}))
    ds = repo.get_dataset(engine, only)
    assert ds.status == "error"
    assert ds.error.startswith("row 1, field 'messages[1].role': the prompt ends on an "
                               "assistant turn; a prompt's messages must end on a user turn")


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
