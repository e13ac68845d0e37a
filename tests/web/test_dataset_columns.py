"""Issue 19 items 9 and 13, and the Low item on repeated warnings, over HTTP: rows with no
trained token listed with the reason, warnings grouped by message, and a column mapping for a
file with other column names (GSM8K's question/answer) that the preview and the run both use."""
from __future__ import annotations

import json
import re

from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations

GSM8K = SHARED / "grpo" / "gsm8k" / "train.jsonl"
DOLLY = SHARED / "messy" / "dolly_pretemplated_eos_marker.jsonl"


def _upload(client, name: str, data: bytes) -> str:
    r = client.post("/datasets", files={"file": (name, data)}, follow_redirects=False)
    assert r.status_code == 303, r.text[:300]
    run_validations(client.app)
    return r.headers["location"].rsplit("/", 1)[1]


def test_untrained_rows_listed_and_warnings_grouped(client):
    ds = _upload(client, DOLLY.name, DOLLY.read_bytes())
    report = client.get(f"/api/datasets/{ds}").json()["report"]
    assert report["no_trained_tokens"] > 0
    assert len(report["untrained"]) == report["no_trained_tokens"]
    page = client.get(f"/datasets/{ds}").text
    table = page.split('id="untrained-rows"')[1].split("</table>")[0]
    first = report["untrained"][0]
    assert f"<td>{first['row']}</td>" in table and "past max_seq_length" in table
    warnings = page.split("<h3>Warnings</h3>")[1].split("</ul>")[0]
    items = re.findall(r"<li>(.*?)</li>", warnings, re.S)
    assert len(items) == 2  # two messages, not one bullet per row
    assert any(i.startswith("151 rows, <code>answer</code>: the literal marker") for i in items)


def test_gsm8k_on_the_sft_page_gets_a_column_mapping(client):
    rows = GSM8K.read_text().splitlines()[:40]
    ds = _upload(client, "train.jsonl", ("\n".join(rows) + "\n").encode())
    assert client.get(f"/api/datasets/{ds}").json()["status"] == "error"
    page = client.get(f"/datasets/{ds}").text
    assert "could not detect the dataset format" in page and "Map the columns" in page
    assert 'href="/runs/new/grpo"' in page  # prompt-only rows: pointed to the GRPO page
    assert re.search(r'<select name="instruction"[^>]*>.*?<option value="question" selected>',
                     page, re.S)
    assert re.search(r'<select name="output"[^>]*>.*?<option value="answer" selected>', page, re.S)

    bad = client.post(f"/datasets/{ds}/columns", data={"instruction": "question", "output": ""})
    assert bad.status_code == 400 and "choose the column that holds the output" in bad.text
    ok = client.post(f"/datasets/{ds}/columns", follow_redirects=False,
                     data={"instruction": "question", "output": "answer", "input": "",
                           "system": ""})
    assert ok.status_code == 303 and ok.headers["location"] == f"/datasets/{ds}"
    assert client.get(f"/api/datasets/{ds}").json()["status"] == "validating"
    assert run_validations(client.app) == 1
    got = client.get(f"/api/datasets/{ds}").json()
    assert (got["status"], got["format"], got["report"]["valid_rows"]) == ("processed", "alpaca", 40)
    assert got["report"]["column_mapping"] == {"instruction": "question", "output": "answer"}
    first = json.loads(rows[0])
    page = client.get(f"/datasets/{ds}").text
    trained = "".join(re.findall(r'<mark class="trained">(.*?)</mark>', page, re.S))
    import html

    assert first["answer"].split("\n")[0] in html.unescape(trained)
    # a re-rendered report (another length) keeps the mapping
    frag = client.get(f"/datasets/{ds}/report", params={"max_seq_length": 256})
    assert frag.status_code == 200 and "alpaca" in frag.text and "could not detect" not in frag.text
    # the run reads the rows the same way: the mapping travels in its spec
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 1})
    assert r.status_code in (200, 201), r.text
    from app.store import repo

    run = repo.get_run(client.app.state.engine, r.json()["id"])
    assert run.spec["column_mapping"] == {"instruction": "question", "output": "answer"}


def test_the_prompts_hint_names_its_columns_in_english(client):
    """The trial's hint read "(a <code>instruction</code> column ...)": "a instruction"."""
    rows = [{"instruction": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]
    ds = _upload(client, "sums.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    page = client.get(f"/datasets/{ds}").text
    hint = page.split("These rows look like prompts", 1)[1].split("</p>", 1)[0]
    assert ("(prompts in the <code>instruction</code> column, reference answers in the "
            "<code>answer</code> column)") in hint
    assert "a <code>" not in hint
