"""Issue 19 item 10 over HTTP: a cancelled (or failed) run exports its newest complete
checkpoint; the worker records each checkpoint as an Artifact(kind="checkpoint").

The worker is simulated through the store (claim, artifacts, cancel), the channel it uses."""
from __future__ import annotations

import json
from pathlib import Path

from app.store import queue, repo
from app.store.schema import Artifact, JobState
from app.store.specs import TrainSpec

from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations


def _running_run(client, engine, save_steps: int = 2) -> tuple[str, int]:
    path = SHARED / "sft" / "identity_alpaca.json"
    r = client.post("/datasets", files={"file": (path.name, path.read_bytes())},
                    follow_redirects=False)
    ds = r.headers["location"].rsplit("/", 1)[1]
    run_validations(client.app)
    model = client.get("/api/models").json()["data"][0]["id"]
    run, job = repo.create_run(engine, TrainSpec(model=model, dataset=ds, max_steps=10,
                                                 save_steps=save_steps))
    assert queue.claim(engine, "w-test", 30, kinds=["train"]).id == job.id
    return run.id, job.id


def _checkpoint(engine, settings, run_id: str, job_id: int, step: int) -> Path:
    folder = settings.data_dir / "runs" / run_id / "checkpoints" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    repo.add_artifact(engine, Artifact(run_id=run_id, job_id=job_id, kind="checkpoint",
                                       name=folder.name, path=str(folder), meta={"step": step}))
    return folder


def _cancel(engine, job_id: int) -> None:
    queue.cancel(engine, job_id)
    if queue.get_job(engine, job_id).state != JobState.CANCELLED:  # the worker acknowledges
        queue.acknowledge_cancel(engine, job_id, "w-test")
    assert queue.get_job(engine, job_id).state == JobState.CANCELLED


def test_cancelled_run_exports_its_newest_checkpoint(client, engine, settings):
    run_id, job_id = _running_run(client, engine)
    page = client.get(f"/runs/{run_id}").text
    assert "the adapter is not saved" not in page
    # no step done yet: the confirmation says a cancel now keeps nothing
    assert "It has not finished a training step yet, so cancelling now saves no checkpoint." \
        in page and "only cloned" in page
    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    assert r.status_code == 409 and "has not finished training" in r.json()["error"]["message"]

    _checkpoint(engine, settings, run_id, job_id, 2)
    _checkpoint(engine, settings, run_id, job_id, 4)
    gone = _checkpoint(engine, settings, run_id, job_id, 6)  # rotated away by the trainer
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    _cancel(engine, job_id)

    frag = client.get(f"/runs/{run_id}/exports").text
    assert 'id="export_form"' in frag
    assert "The run was cancelled: exports are made from its newest checkpoint, step 4." in frag
    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "gguf", "quantization": "Q8_0"})
    assert r.status_code == 201, r.text
    job = queue.get_job(engine, r.json()["id"])
    assert job.payload["checkpoint_step"] == 4 and job.payload["format"] == "gguf"
    info = client.get(f"/api/exports/{job.id}").json()
    assert info["checkpoint_step"] == 4
    assert "from checkpoint 4" in client.get(f"/runs/{run_id}/exports").text
    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter", "checkpoint_step": 2})
    assert r.status_code == 201 and queue.get_job(engine, r.json()["id"]).payload[
        "checkpoint_step"] == 2
    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter", "checkpoint_step": 6})
    assert r.status_code == 422 and r.json()["error"]["param"] == "checkpoint_step"
    assert "checkpoints on disk: 4, 2" in r.json()["error"]["message"]


def test_cancelled_before_any_checkpoint_says_so(client, engine):
    run_id, job_id = _running_run(client, engine, save_steps=50)
    _cancel(engine, job_id)
    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    msg = r.json()["error"]["message"]
    assert r.status_code == 409 and "was cancelled before it saved a checkpoint" in msg
    assert "has not finished training" not in msg
    frag = client.get(f"/runs/{run_id}/exports").text
    assert 'id="export_form"' not in frag
    assert "cancelled before it saved a checkpoint (one is saved every save_steps = 50 " \
        "steps)" in frag


def test_downloads_are_named_by_the_run_name(client, engine, settings):
    """Issue 19 (Low): files of a named run download under a slug of its name, not its id."""
    import io
    import zipfile
    from urllib.parse import quote

    run_id, job_id = _running_run(client, engine)
    _rename(engine, run_id, "My run: v2 (final)")
    assert queue.finish(engine, job_id, "w-test", {"steps": 10})
    adapter = settings.data_dir / "runs" / run_id / "adapter.zip"
    adapter.parent.mkdir(parents=True, exist_ok=True)
    adapter.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    art = repo.add_artifact(engine, Artifact(run_id=run_id, job_id=job_id, kind="adapter",
                                             name="adapter.zip", path=str(adapter), bytes=22))
    r = client.get(f"/artifacts/{art.id}/download")
    assert r.status_code == 200
    assert 'filename="my-run-v2-final-adapter.zip"' in r.headers["content-disposition"]

    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "gguf", "quantization": "Q8_0"})
    exp = queue.claim(engine, "w-export", 30, kinds=["export"])
    gguf = settings.data_dir / "exports" / f"export-{exp.id}" / f"{run_id}-Q8_0.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    repo.add_artifact(engine, Artifact(run_id=run_id, job_id=exp.id, kind="gguf", name=gguf.name,
                                       path=str(gguf), bytes=4,
                                       meta={"export_id": f"export-{exp.id}"}))
    assert queue.finish(engine, exp.id, "w-export", {"export_id": f"export-{exp.id}"})
    r = client.get(f"/exports/{exp.id}/download.zip")
    assert r.status_code == 200
    assert f'filename="my-run-v2-final-gguf-{exp.id}.zip"' in r.headers["content-disposition"]
    assert zipfile.ZipFile(io.BytesIO(r.content)).namelist() == ["my-run-v2-final-Q8_0.gguf"]

    # a name in other scripts keeps its letters (trial s23 L-9: "ünïcødé 名前" downloaded as
    # "unicde"), sent as RFC 6266 filename* in UTF-8; markup characters still go
    _rename(engine, run_id, "🔥 Ünïcødé 名前 <b>x</b>")
    r = client.get(f"/artifacts/{art.id}/download")
    want = "ünïcødé-名前-b-x-b-adapter.zip"
    assert r.headers["content-disposition"] == f"attachment; filename*=utf-8''{quote(want)}"
    r = client.get(f"/exports/{exp.id}/download.zip")
    assert zipfile.ZipFile(io.BytesIO(r.content)).namelist() == ["ünïcødé-名前-b-x-b-Q8_0.gguf"]


def _rename(engine, run_id: str, name: str) -> None:
    from app.store.db import session_scope
    from app.store.schema import Run

    with session_scope(engine, immediate=True) as s:
        run = s.get(Run, run_id)
        run.name = name
        s.add(run)
