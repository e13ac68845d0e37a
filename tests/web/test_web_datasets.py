"""Dataset uploads through the browser form: every shared file previews or fails clearly."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations, signed_in

FILES = sorted(p for sub in ("sft", "messy") if (SHARED / sub).is_dir()
               for p in (SHARED / sub).iterdir() if p.is_file())


def _alert(html: str) -> str:
    m = re.search(r'class="alert error" role="alert">(.*?)</div>', html, re.S)
    return re.sub(r"<[^>]+>", "", m.group(1)) if m else ""


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_browser_upload_every_file(client, path: Path, settings):
    with path.open("rb") as fh:
        r = client.post("/datasets", files={"file": (path.name, fh)}, follow_redirects=False)
    assert r.status_code == 303, r.text[:500]  # recorded at once, validated in the background
    ds_id = r.headers["location"].rsplit("/", 1)[1]
    waiting = client.get(r.headers["location"])
    assert waiting.status_code == 200 and "validating" in waiting.text
    assert client.get("/api/datasets/" + ds_id).json()["status"] == "validating"
    assert run_validations(client.app) == 1
    status = client.get("/api/datasets/" + ds_id).json()["status"]
    assert status in ("processed", "error")
    if status == "processed":
        page = client.get(r.headers["location"])
        assert page.status_code == 200
        assert "Validation report" in page.text
        assert 'class="trained"' in page.text  # preview with trained tokens highlighted
        assert 'class="histogram"' in page.text
        ds = client.get("/api/datasets/" + r.headers["location"].rsplit("/", 1)[1]).json()
        assert ds["report"]["valid_rows"] > 0 and ds["format"]
    else:
        msg = _alert(client.get(r.headers["location"]).text)
        assert re.search(r"row \d+", msg), msg  # the error names the row


def test_messy_errors_name_row_and_field(client):
    path = SHARED / "messy" / "sharegpt_empty_assistant_turn.json"
    with path.open("rb") as fh:
        r = client.post("/datasets", files={"file": (path.name, fh)})
    run_validations(client.app)
    msg = _alert(client.get(r.url).text)
    assert r.status_code == 200 and "row 1" in msg and "conversations[1].value" in msg


def test_oversize_upload_is_rejected_and_leaves_nothing(client, settings):
    big = b'{"text": "' + b"x" * (settings.max_upload_mb * 1024 * 1024 + 10) + b'"}\n'
    r = client.post("/datasets", files={"file": ("big.jsonl", big)})
    assert r.status_code == 413
    assert "upload limit of 8 MiB" in _alert(r.text)
    assert list((settings.data_dir / "uploads").iterdir()) == []
    assert client.get("/api/datasets").json()["data"] == []


def test_oversize_is_enforced_while_streaming(app, settings):
    """Without a Content-Length header the limit still holds chunk by chunk."""

    boundary = "XyZ"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.txt\"\r\n"
            "Content-Type: text/plain\r\n\r\n").encode()

    def body():
        yield head
        for _ in range(settings.max_upload_mb + 2):
            yield b"y" * (1024 * 1024)
        yield f"\r\n--{boundary}--\r\n".encode()

    with signed_in(app) as c:
        r = c.post("/datasets", content=body(),
                   headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413
    assert list((settings.data_dir / "uploads").iterdir()) == []


def test_unsupported_and_empty_files(client):
    r = client.post("/datasets", files={"file": ("notes.docx", b"hello")})
    assert r.status_code == 400 and "unsupported file type" in _alert(r.text)
    r = client.post("/datasets", files={"file": ("empty.jsonl", b"")})
    assert r.status_code == 400 and "empty" in _alert(r.text)


def test_report_fragment_adjusts_max_seq_length(client):
    path = SHARED / "sft" / "alpaca_en_demo.json"
    with path.open("rb") as fh:
        r = client.post("/datasets", files={"file": (path.name, fh)}, follow_redirects=False)
    ds_id = r.headers["location"].rsplit("/", 1)[1]
    run_validations(client.app)
    hx = {"HX-Request": "true"}
    r = client.get(f"/datasets/{ds_id}/report?max_seq_length=16&chat_template=llama3", headers=hx)
    assert r.status_code == 200 and r.text.lstrip().startswith('<div id="report"')
    assert "Over max_seq_length (16)" in r.text and "llama3" in r.text
    r = client.get(f"/datasets/{ds_id}/report?max_seq_length=abc", headers=hx)
    assert r.status_code == 422 and "max_seq_length must be" in r.text


def test_first_report_counts_against_the_run_forms_length(client, engine):
    """The upload's report and the run form start from the same max_seq_length: TrainSpec's 1024
    capped at the model's context (512 here), so "over max_seq_length" counts what the run will
    truncate; the report page and its "Train" link carry that length."""
    from app.store import repo

    model = repo.get_model(engine, "stories260K")
    repo.update_model(engine, model.id, status="ready", info={"max_position_embeddings": 512})
    path = SHARED / "sft" / "alpaca_en_demo.json"
    with path.open("rb") as fh:
        r = client.post("/datasets", files={"file": (path.name, fh)}, follow_redirects=False)
    ds_id = r.headers["location"].rsplit("/", 1)[1]
    run_validations(client.app)
    assert repo.get_dataset(engine, ds_id).report["max_seq_length"] == 512
    page = client.get(f"/datasets/{ds_id}").text
    assert "Over max_seq_length (512)" in page and 'name="max_seq_length" min="8" max="1048576" value="512"' in page
    assert "max_seq_length=512" in page
    assert 'name="max_seq_length" value="512"' in client.get(f"/runs/new?dataset={ds_id}").text
    # a model with no recorded context keeps TrainSpec's default
    repo.update_model(engine, model.id, info={})
    frag = client.get(f"/datasets/{ds_id}/report", headers={"HX-Request": "true"}).text
    assert "Over max_seq_length (1024)" in frag


def test_report_query_params_on_the_page_and_train_link(client):
    """Enter in the selector without htmx GETs the page with the params: they are honoured, and
    "Train on this dataset" carries template and length into a pre-filled run form."""
    path = SHARED / "sft" / "alpaca_en_demo.json"
    with path.open("rb") as fh:
        r = client.post("/datasets", files={"file": (path.name, fh)}, follow_redirects=False)
    ds_id = r.headers["location"].rsplit("/", 1)[1]
    run_validations(client.app)
    page = client.get(f"/datasets/{ds_id}")
    assert 'hx-trigger="change, submit"' in page.text and 'action="/datasets/' in page.text
    r = client.get(f"/datasets/{ds_id}?chat_template=llama3&max_seq_length=16")
    assert r.status_code == 200
    assert "Over max_seq_length (16)" in r.text and 'value="16"' in r.text
    assert "chat_template=llama3" in r.text and "max_seq_length=16" in r.text
    # the htmx report fragment updates the link out of band
    frag = client.get(f"/datasets/{ds_id}/report?chat_template=zephyr&max_seq_length=64",
                      headers={"HX-Request": "true", "HX-Target": "report"}).text
    assert 'hx-swap-oob="true"' in frag and "chat_template=zephyr" in frag
    r = client.get(f"/datasets/{ds_id}?max_seq_length=abc")
    assert r.status_code == 422 and "a whole number from 8 to 1048576 tokens" in r.text
    form = client.get(f"/runs/new?dataset={ds_id}&chat_template=llama3&max_seq_length=16").text
    assert 'name="max_seq_length" value="16"' in form
    assert "<option selected>llama3</option>" in form and "start_header_id" in form
    assert f'value="{ds_id}" selected' in form


def test_json_uploaded_as_txt_warns_with_the_right_extension(client, tmp_path):
    """A .txt file that is really JSON Lines (or a JSON array) is read as text, with a warning."""
    import json

    rows = [{"instruction": f"say {i}", "output": str(i)} for i in range(3)]
    cases = {"rows.txt": "\n".join(json.dumps(r) for r in rows) + "\n",
             "array.txt": json.dumps(rows, indent=2),
             "plain.txt": "just some text\n{not json}\n"}
    for name, content in cases.items():
        path = tmp_path / name
        path.write_text(content)
        with path.open("rb") as fh:
            r = client.post("/datasets", files={"file": (name, fh)}, follow_redirects=False)
        assert r.status_code == 303, r.text
        run_validations(client.app)
        page = client.get(r.headers["location"]).text
        ds = client.get("/api/datasets/" + r.headers["location"].rsplit("/", 1)[1]).json()
        warnings = [w["message"] for w in ds["report"]["warnings"]]
        if name == "plain.txt":
            assert not any("rename it" in w for w in warnings)
            continue
        ext = ".jsonl" if name == "rows.txt" else ".json"
        assert any(f"rename it to {ext}" in w and "instruction, output" in w for w in warnings), warnings
        assert 'class="alert warn"' in page and f"rename it to {ext}" in page


def test_a_parquet_upload_is_counted_by_the_job_not_the_web(client, tmp_path):
    """The web records a Parquet upload without reading it (pyarrow stays out of the web
    process: its first import held the interpreter for 1.5 s in CI while /healthz waited); the
    validation job counts its rows from the footer as it starts, so the progress says "of N"."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from app.store import events as store_events
    from app.studio import validation

    rows = json.loads((SHARED / "sft" / "alpaca_en_demo.json").read_text())[:300]
    path = tmp_path / "alpaca.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    with path.open("rb") as fh:
        r = client.post("/datasets", files={"file": (path.name, fh)}, follow_redirects=False)
    assert r.status_code == 303, r.text[:500]
    ds_id = r.headers["location"].rsplit("/", 1)[1]
    ds = client.get("/api/datasets/" + ds_id).json()
    assert ds["status"] == "validating" and ds["report"]["validating"]["total"] is None
    assert "0/? rows" in validation.progress_text(
        validation.repo.get_dataset(client.app.state.engine, ds_id))
    assert run_validations(client.app) == 1
    ds = client.get("/api/datasets/" + ds_id).json()
    assert ds["status"] == "processed" and ds["rows"] == 300, ds
    job_id = ds["report"]["validation_job_id"]
    progress = [e.data for e in store_events.since(client.app.state.engine, job_id)
                if e.type == "progress"]
    assert progress and all(p["total"] == 300 for p in progress), progress
    assert progress[-1]["message"] == "validating 300 / 300 rows"
