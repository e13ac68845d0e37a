"""A fresh user's trial of the dataset pages (over HTTP, validations by the real job function):
the GRPO hint only for rows that really are prompts, a truncated preview row says so, and a
max_seq_length under the least gets the same field-named message as one over the most."""
from __future__ import annotations

import json

import pytest

from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations
from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")

GSM8K = SHARED / "grpo" / "gsm8k" / "train.jsonl"
HINT = "These rows look like prompts for reinforcement learning"


def _upload(client, name: str, data: bytes) -> str:
    r = client.post("/datasets", files={"file": (name, data)}, follow_redirects=False)
    assert r.status_code == 303, r.text[:300]
    run_validations(client.app)
    return r.headers["location"].rsplit("/", 1)[1]


def _jsonl(rows) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def test_the_grpo_hint_is_for_prompt_rows_not_for_a_broken_chat_file(client):
    # a messages file whose every row is broken (an empty assistant turn, the turns out of
    # order, legacy prompt/completion pairs mixed in): no row validates, the page offers the
    # column mapping, and the prompt column is there, but the rows are chats, not prompts
    broken = []
    for i in range(4):
        broken += [{"messages": [{"role": "user", "content": f"question {i}"},
                                 {"role": "assistant", "content": ""}]},
                   {"messages": [{"role": "assistant", "content": f"answer {i}"},
                                 {"role": "user", "content": f"question {i}"}]},
                   {"prompt": f"question {i}", "completion": f"answer {i}"}]
    ds = _upload(client, "chat.jsonl", _jsonl(broken))
    assert client.get(f"/api/datasets/{ds}").json()["status"] == "error"
    page = client.get(f"/datasets/{ds}").text
    assert "Map the columns" in page and HINT not in page

    prompts = GSM8K.read_text().splitlines()[:20]
    ds = _upload(client, "train.jsonl", ("\n".join(prompts) + "\n").encode())
    page = client.get(f"/datasets/{ds}").text
    assert HINT in page and "<code>question</code> column" in page


def test_a_truncated_preview_row_says_it_was_cut(client):
    long = " ".join(f"word{i}" for i in range(400))
    rows = [{"instruction": long, "output": "fine"}, {"instruction": "hi", "output": "hello"}]
    ds = _upload(client, "long.jsonl", _jsonl(rows))
    frag = client.get(f"/datasets/{ds}/report", params={"max_seq_length": 64})
    assert frag.status_code == 200
    previews = frag.text.split('<div class="preview">')[1:]
    report = client.get(f"/api/datasets/{ds}").json()["report"]  # the stored one, full length
    n = report["preview"][0]["num_tokens"]
    assert n > 64
    assert f"… (truncated: {n:,} tokens, max_seq_length 64)" in previews[0]
    assert "truncated" not in previews[1]  # a row that fits says nothing
    # the stored report's length holds the whole row: no note there
    assert report["preview"][0]["truncation_note"] is None
    # a report stored before the note existed, at a length that cuts the row, shows it too
    from app.store import repo

    engine = client.app.state.engine
    old = {**report, "max_seq_length": 64,
           "preview": [{k: v for k, v in p.items() if k != "truncation_note"}
                       for p in report["preview"]]}
    repo.update_dataset(engine, ds, report=old)
    page = client.get(f"/datasets/{ds}").text
    assert f"… (truncated: {n:,} tokens, max_seq_length 64)" in page


def test_a_too_small_max_seq_length_is_refused_by_name_on_every_surface(client):
    ds = _upload(client, "tiny.jsonl", _jsonl([{"instruction": "hi", "output": "hello"}]))
    want = "max_seq_length must be a whole number from 8 to 1048576 tokens"
    for raw in ("-5", "0", "7", "1048577", "abc"):
        for url in (f"/datasets/{ds}", f"/datasets/{ds}/report"):
            r = client.get(url, params={"max_seq_length": raw})
            assert r.status_code == 422 and want in r.text, (url, raw)
    page = client.get(f"/datasets/{ds}").text
    form = page.split('id="report_form"', 1)[1].split("</form>", 1)[0]
    assert "novalidate" in form.split(">", 1)[0]  # the browser's check cannot swallow it
    assert 'min="8" max="1048576"' in form


@pytest.mark.browser
@needs_chromium
def test_the_dataset_page_shows_why_a_small_max_seq_length_is_refused(client, app, page):
    from playwright.sync_api import expect

    ds = _upload(client, "tiny.jsonl", _jsonl([{"instruction": "hi", "output": "hello"}]))
    page.goto(f"{page.base}/datasets/{ds}")
    field = page.locator("#report_form input[name=max_seq_length]")
    for raw in ("-5", "0", "2000000"):
        field.fill(raw)
        field.press("Enter")
        expect(page.locator("#report .alert.error")).to_contain_text(
            "max_seq_length must be a whole number from 8 to 1048576 tokens")
        page.goto(f"{page.base}/datasets/{ds}")  # the error cleared for the next value
    field.fill("64")
    field.press("Enter")
    expect(page.locator("#report")).to_contain_text("Over max_seq_length (64)")
    expect(page.locator("#report .alert.error")).to_have_count(0)


def test_no_column_mapping_where_a_mapping_cannot_help(client):
    """The column-mapping form is for files whose columns were not recognised; a file that is
    not UTF-8 (its columns read fine up to the bad byte) or a chat file whose only row is broken
    gets the error alone (trial s21 F14), and one row is "the only row", not "all 1 rows"."""
    messy = SHARED / "messy"
    ds = _upload(client, "sms_spam_kaggle_latin1.csv", (messy / "sms_spam_kaggle_latin1.csv").read_bytes())
    page = client.get(f"/datasets/{ds}").text
    assert "invalid UTF-8 byte 0xe5" in page and "re-save it as UTF-8" in page
    assert "Map the columns" not in page
    ds = _upload(client, "chat.json", (messy / "sharegpt_empty_assistant_turn.json").read_bytes())
    err = client.get(f"/api/datasets/{ds}").json()
    assert err["status"] == "error"
    page = client.get(f"/datasets/{ds}").text
    assert "empty assistant turn (no usable rows: the only row is invalid)" in page, err
    assert "Map the columns" not in page and "all 1 rows" not in page
