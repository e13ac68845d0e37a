"""The queue, run page and jobs table as a fresh user meets them: the queue names your runs
(others' stay anonymous), every page says a job's memory estimate the same way, the run page's
polled queue note carries the job's state, an idle playground session's note keeps its numbers
straight, and a dataset validation that rejected the dataset says so."""
from __future__ import annotations

import re

from app.store import queue, repo, workers
from app.store.admission import Slot
from app.store.specs import TrainSpec
from app.studio.queue_view import session_notes
from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations, signed_in, upload_sft

GPU = Slot("box-gpu0", "box", 0, 22.0, 24.0)


def _runs(client, engine, owner: str, names: list[str], estimate_gib: float = 0.07) -> list[str]:
    """Queue one run per name on the demo model (estimate as the run form stores it)."""
    ds = upload_sft(client, "alpaca_en_demo.json")
    model = client.get("/api/models").json()["data"][0]["id"]
    return [repo.create_run(engine, TrainSpec(model=model, dataset=ds, max_steps=2), name=n,
                            owner=owner, estimate_gib=estimate_gib)[0].id for n in names]


def test_queue_names_my_runs_and_keeps_others_anonymous(app, client, engine) -> None:
    admin_id = client.get("/api/me").json()["id"]
    r = client.post("/api/users", json={"name": "bea", "password": "member-password-1"})
    bea = r.json()["id"]
    workers.register(engine, GPU.id, GPU.host, 1, "cuda:0 NVIDIA test", 24.0, 0, 0.3)  # no room
    mine = _runs(client, engine, admin_id, ["tiny stories lr 3e-4"])[0]
    with signed_in(app, "bea", "member-password-1") as c:
        hers = _runs(c, engine, bea, ["bea's secret run"])[0]
        html = c.get("/queue").text
        assert "bea&#39;s secret run" in html and f'href="/runs/{hers}"' in html
        assert "tiny stories lr 3e-4" not in html and mine not in html
        waiting = html[html.index("<h2>Waiting"):html.index('id="cpu-lane"')]
        assert waiting.count("another user's job") == 1 and "for the job +" in waiting
        data = c.get("/api/queue").json()["waiting"]
        assert [(w["visible"], w["run_name"]) for w in data] == [(False, None),
                                                                 (True, "bea's secret run")]
    html = client.get("/queue").text
    assert f'<a class="run-name" href="/runs/{mine}">tiny stories lr 3e-4</a>' in html
    assert f'<span class="muted small">{mine} · train</span>' in html


def test_every_page_says_the_memory_estimate_the_same_way(app, client, engine) -> None:
    from tests.web.test_vram_web import FORM, _llama

    workers.register(engine, GPU.id, GPU.host, 1, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    model = _llama(engine)
    form = client.post("/runs/new/estimate", data={**FORM, "model": model.id}).text
    m = re.search(r'Estimated <strong id="estimate-total">(7\.2 GiB on the GPU)</strong>\s*'
                  r'\((6\.7\d GiB for training \+ 0\.5 GiB CUDA context);', form)
    assert m, form
    short, parts = m.groups()
    ds = upload_sft(client, "alpaca_en_demo.json")
    run_id = client.post("/api/runs", json={
        "model": model.id, "dataset": ds, "load_in_4bit": True, "max_seq_length": 2048,
        "per_device_train_batch_size": 2}).json()["id"]
    page = client.get(f"/runs/{run_id}").text
    assert f'id="mem-estimate">{short}<span class="small muted mem-parts"> ({parts})</span>' in page
    q = client.get("/queue").text
    assert f"{short}<div class=\"small muted mem-detail\">{parts}; admitted as 8.9 GiB (" in q
    words = client.get(f"/api/runs/{run_id}").json()["memory"]["words"]
    assert words["text"] == f"{short} ({parts})"


def test_polled_queue_note_carries_the_state(app, client, engine) -> None:
    admin_id = client.get("/api/me").json()["id"]
    workers.register(engine, GPU.id, GPU.host, 1, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    run_id = _runs(client, engine, admin_id, ["claimed soon"])[0]
    hx = {"HX-Request": "true", "HX-Target": "place"}
    frag = client.get(f"/runs/{run_id}", headers=hx).text
    assert 'data-state="queued"' in frag and "1st in the queue" in frag
    badge = '<span id="m-state" class="state state-{0}" hx-swap-oob="true">{0}</span>'
    assert badge.format("queued") in frag
    assert queue.admit(engine, GPU, 300, ["train"], 0.25, 24.0) is not None
    frag = client.get(f"/runs/{run_id}", headers=hx).text
    assert "in the queue" not in frag and 'data-state="running"' in frag
    assert badge.format("running") in frag
    # the whole page has one state badge (the out-of-band copy is for the polled fragment only)
    assert client.get(f"/runs/{run_id}").text.count('id="m-state"') == 1


def test_idle_session_note_says_how_long_idle_and_when_it_yields(app, client, engine,
                                                                monkeypatch) -> None:
    from tests.web.test_queue_web import idle_session

    # the numbers add up: idle 4 s + 11 s = the 15 s yield; past it, no "in -13 s"
    own, theirs = session_notes(("idle", 4.2), 15.0, "job 7", "playground session job 3")
    assert own == ("idle playground session, idle 4 s: gives its slot to job 7 in 11 s "
                   "(at 15 s idle) unless it gets a prompt")
    assert theirs == ("waits for playground session job 3: idle 4 s; it gives its slot in 11 s "
                      "(at 15 s idle) unless it gets a prompt")
    own, theirs = session_notes(("idle", 28.4), 15.0, None, "x")
    assert own == ("idle playground session, idle 28 s: no job waits for its slot; it gives "
                   "the slot up after 15 s idle when one does") and theirs is None
    # the yield is the session's own (its payload's, what its worker counts), not today's setting
    admin_id = client.get("/api/me").json()["id"]
    workers.register(engine, GPU.id, GPU.host, 1, "cuda:0 NVIDIA test", 24.0, 0, 22.0)
    idle_session(engine, monkeypatch, GPU, admin_id, 28, 15.0, {"yield_seconds": 60.0})
    train = queue.enqueue(engine, "train", {}, owner=admin_id, estimate_gib=10.0).id
    data = client.get("/api/queue").json()
    assert data["gpus"][0]["running"][0]["note"] == (
        f"idle playground session, idle 28 s: gives its slot to job {train} in 32 s (at 60 s "
        "idle) unless it gets a prompt")


def test_jobs_table_says_a_rejected_dataset_was_rejected(app, client, engine) -> None:
    path = SHARED / "messy" / "sharegpt_empty_assistant_turn.json"
    with path.open("rb") as fh:
        client.post("/datasets", files={"file": (path.name, fh)}, follow_redirects=False)
    assert run_validations(app) == 1
    good = upload_sft(client, "alpaca_en_demo.json")
    html = client.get("/", headers={"HX-Request": "true", "HX-Target": "jobs"}).text
    rows = re.findall(r'<tr data-job="\d+" data-kind="validate_dataset">(.*?)</tr>', html, re.S)
    bad_row, good_row = rows[1], rows[0]  # newest first
    assert "rejected" in bad_row and "succeeded" not in bad_row
    assert ("dataset rejected: row 1, field &#39;conversations[1].value&#39;: empty assistant "
            "turn") in bad_row
    assert good in good_row and "dataset valid:" in good_row and "rejected" not in good_row


def _for_cells(html: str) -> dict[str, str]:
    """The Jobs table's "For" cell of each train job on the dashboard, by job id."""
    table = html[html.index('id="jobs-table"'):]
    return dict(re.findall(r'<tr data-job="(\d+)" data-kind="train">.*?<td data-label="For" '
                           r'class="wide name-cell">(.*?)</td>', table, re.S))


def test_jobs_table_names_the_run_as_the_queue_does(app, client, engine) -> None:
    admin_id = client.get("/api/me").json()["id"]
    bea = client.post("/api/users", json={"name": "bea", "password": "member-password-1"}
                      ).json()["id"]
    mine = _runs(client, engine, admin_id, ["tiny stories lr 3e-4"])[0]
    with signed_in(app, "bea", "member-password-1") as c:
        hers = _runs(c, engine, bea, ["bea's secret run"])[0]
        cells = _for_cells(c.get("/").text)
        job = str(repo.get_run(engine, hers).job_id)
        assert cells == {job: f'<a class="run-name" href="/runs/{hers}">bea&#39;s secret run</a>'
                              f' <span class="muted small">{hers}</span>'}
        assert "tiny stories lr 3e-4" not in c.get("/").text  # another user's job: not listed
    cells = _for_cells(client.get("/").text)  # an admin sees every run's name
    assert f'<a class="run-name" href="/runs/{mine}">tiny stories lr 3e-4</a>' in \
        cells[str(repo.get_run(engine, mine).job_id)]
    assert "bea&#39;s secret run" in cells[str(repo.get_run(engine, hers).job_id)]
