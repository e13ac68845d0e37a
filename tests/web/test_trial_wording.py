"""Small wording findings of the new-user trial, over HTTP: numbers printed as given."""
from __future__ import annotations


def test_too_large_max_tokens_is_printed_as_given(client) -> None:
    model = client.get("/api/models").json()["data"][0]["id"]
    for given, shown in ((1000000000, "1000000000"), ("20000", "20000"), (9000.0, "9000")):
        r = client.post("/api/playground/sessions", json={"model": model, "max_tokens": given})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert (err["param"], err["message"]) == (
            "max_tokens", f"must be at least 1 and at most 8192, not {shown}"), err


def _lane(html: str, job_id: int) -> str:
    import re

    row = html[html.index(f'<tr data-job="{job_id}"'):]
    return re.findall(r'<td data-label="Lane">([^<]*)</td>', row[:row.index("</tr>")])[0]


def test_jobs_lane_is_named_as_the_slot_it_is(client, engine) -> None:
    """A CPU-only box's training job waits for the "CPU slot (no GPU)", not "gpu"."""
    from app.store import queue, workers

    me = client.get("/api/me").json()["id"]
    train = queue.enqueue(engine, "train", {}, owner=me).id
    export = queue.enqueue(engine, "export", {}, owner=me, priority=5).id
    workers.register(engine, "vm-main", "vm", 1, "cpu slot (2 cores, one job at a time)")
    html = client.get("/").text
    assert (_lane(html, train), _lane(html, export)) == ("CPU slot (no GPU)", "CPU lane")
    assert "Training waits for the CPU slot (no GPU: one job at a time)" in html
    assert "GPU lane" not in html and ">gpu</td>" not in html
    queue_page = client.get("/queue").text
    assert "<h2>Slots (no GPU)</h2>" in queue_page and "<h2>GPUs</h2>" not in queue_page
    workers.register(engine, "box-gpu0", "box", 2, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    html = client.get("/").text
    assert (_lane(html, train), _lane(html, export)) == ("GPU slot", "CPU lane")
    assert "<h2>GPUs</h2>" in client.get("/queue").text


def test_dataset_report_bounds_max_seq_length_as_the_run_form_does(client) -> None:
    from app.store.specs import TrainSpec
    from tests.conftest import SHARED_DATA
    from tests.web.conftest import run_validations

    path = SHARED_DATA / "sft" / "alpaca_en_demo.json"
    r = client.post("/datasets", files={"file": (path.name, path.read_bytes())},
                    follow_redirects=False)
    ds_id = r.headers["location"].rsplit("/", 1)[1]
    run_validations(client.app)
    hx = {"HX-Request": "true"}
    meta = TrainSpec.model_fields["max_seq_length"].metadata
    assert [getattr(m, "ge", None) or getattr(m, "le", None) for m in meta] == [8, 1048576]
    for bad in ("100000000000000000000000", "1048577", "7", "abc", "1e3"):
        r = client.get(f"/datasets/{ds_id}/report?max_seq_length={bad}", headers=hx)
        assert r.status_code == 422, bad
        assert "max_seq_length must be a whole number from 8 to 1048576 tokens" in r.text, bad
    r = client.get(f"/datasets/{ds_id}/report?max_seq_length=1048576", headers=hx)
    assert r.status_code == 200 and "Over max_seq_length (1048576)" in r.text
