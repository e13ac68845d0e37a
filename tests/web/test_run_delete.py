"""Deleting runs, exports and datasets with their files (issue 16), refused with the reason
while a job uses them. The worker is simulated through the store (claim, artifacts, finish,
cancel), the channel it uses."""
from __future__ import annotations

from markupsafe import escape

from app.store import queue, repo
from app.store.schema import Artifact, JobState
from app.store.specs import TrainSpec
from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in, upload_sft
from tests.web.test_export_checkpoint import _cancel, _checkpoint, _rename, _running_run


def _built_export(client, engine, settings, run_id: str) -> tuple[int, object]:
    """An adapter export of ``run_id`` built by a simulated worker: (its id, its file)."""
    r = client.post(f"/api/runs/{run_id}/exports", json={"format": "adapter"})
    assert r.status_code == 201, r.text
    job = queue.claim(engine, "w-export", 30, kinds=["export"])
    f = settings.data_dir / "exports" / f"export-{job.id}" / "adapter.zip"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"PK\5\6" + b"\0" * 18)
    repo.add_artifact(engine, Artifact(run_id=run_id, job_id=job.id, kind="adapter",
                                       name=f.name, path=str(f), bytes=22, sha256="0" * 64,
                                       meta={"export_id": f"export-{job.id}"}))
    return job.id, f


def test_delete_run_and_export_refused_while_in_use(app, client, engine, settings):
    run_id, job_id = _running_run(client, engine)
    ds_id = repo.get_run(engine, run_id).dataset_id
    ds_page = client.get(f"/datasets/{ds_id}").text
    assert f'hx-post="/datasets/{ds_id}/delete"' in ds_page
    r = client.post(f"/datasets/{ds_id}/delete", headers={"HX-Request": "true"})
    # an unnamed run goes by its id, as its page's heading
    assert r.status_code == 409 and (f"is used by run {run_id}, whose training job is running: "
                                     "delete it once that has ended (or cancel it)") in r.text
    r = client.delete(f"/api/runs/{run_id}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "run_in_use"
    assert "its training job is running" in r.json()["error"]["message"]
    assert 'id="delete-run"' not in client.get(f"/runs/{run_id}").text
    r = client.post(f"/runs/{run_id}/delete", headers={"HX-Request": "true"})
    assert r.status_code == 409 and "its training job is running" in r.text

    folder = _checkpoint(engine, settings, run_id, job_id, 2)
    _cancel(engine, job_id)
    assert 'id="delete-run"' in client.get(f"/runs/{run_id}").text
    export_id, export_file = _built_export(client, engine, settings, run_id)
    r = client.delete(f"/api/exports/{export_id}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "export_in_use"
    assert f"export {export_id} is being built (running)" in r.json()["error"]["message"]
    r = client.delete(f"/api/runs/{run_id}")
    assert r.status_code == 409 and f"export {export_id} is running" in r.json()["error"]["message"]
    assert queue.finish(engine, export_id, "w-export", {})

    # another user's run or export answers as if it did not exist
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    accounts.create_user(engine, "bea", "bea-password-1", actor=admin)
    with signed_in(app, "bea", "bea-password-1") as bea:
        assert bea.delete(f"/api/exports/{export_id}").status_code == 404
        assert bea.delete(f"/api/runs/{run_id}").status_code == 404
        assert bea.post(f"/runs/{run_id}/delete").status_code == 404
    assert export_file.is_file() and folder.is_dir()

    # the export's Delete button, then the run's
    frag = client.get(f"/runs/{run_id}/exports").text
    assert f'hx-post="/exports/{export_id}/delete"' in frag
    r = client.post(f"/exports/{export_id}/delete", headers={"HX-Request": "true"})
    assert r.status_code == 200 and f'id="export-{export_id}"' not in r.text
    assert not export_file.parent.exists()
    assert client.get(f"/api/runs/{run_id}/exports").json()["data"] == []
    assert client.get(f"/api/exports/{export_id}").status_code == 404

    second, second_file = _built_export(client, engine, settings, run_id)
    assert queue.finish(engine, second, "w-export", {})
    r = client.post(f"/runs/{run_id}/delete", headers={"HX-Request": "true"})
    assert r.status_code == 200 and r.headers["HX-Redirect"] == "/"
    run_dir = settings.data_dir / "runs" / run_id
    assert not run_dir.exists() and not second_file.parent.exists()
    assert client.get(f"/api/runs/{run_id}").status_code == 404
    assert run_id not in client.get("/api/runs").text
    # the training job stays as the record of the GPU time it used; the export is gone
    assert queue.get_job(engine, job_id).run_id is None
    assert client.get(f"/api/exports/{second}").status_code == 404
    # no run uses the dataset now: its page's Delete removes it and its file
    ds_file = settings.data_dir / "uploads"
    files = sorted(ds_file.iterdir())
    r = client.post(f"/datasets/{ds_id}/delete", headers={"HX-Request": "true"})
    assert r.status_code == 200 and r.headers["HX-Redirect"] == "/datasets"
    assert len(sorted(ds_file.iterdir())) == len(files) - 1
    assert client.get(f"/api/datasets/{ds_id}").status_code == 404


def test_a_validation_file_in_use_is_not_deleted(client, engine):
    ids = [upload_sft(client), upload_sft(client, "alpaca_en_demo.json")]
    model = client.get("/api/models").json()["data"][0]["id"]
    run, job = repo.create_run(engine, TrainSpec(model=model, dataset=ids[0], max_steps=10,
                                                 validation_file=ids[1]))
    r = client.delete(f"/api/datasets/{ids[1]}")
    assert r.status_code == 409, r.text
    assert r.json()["error"]["message"] == (
        f"alpaca_en_demo.json is the validation_file of run {run.id}, whose training job is "
        "queued: delete it once that has ended (or cancel it)")
    queue.cancel(engine, job.id)
    assert queue.get_job(engine, job.id).state == JobState.CANCELLED
    assert client.delete(f"/api/datasets/{ids[1]}").status_code == 200


def test_a_run_a_playground_session_uses_says_where_to_stop_it(client, engine):
    """A trial deleted a run right after chatting with it over /v1: the refusal named
    "playground job 65", an id the user never saw."""
    run_id, job_id = _running_run(client, engine)
    queue.finish(engine, job_id, queue.get_job(engine, job_id).lease_owner, {})
    session = queue.enqueue(engine, "playground", {"run_id": run_id}, run_id=run_id)
    r = client.delete(f"/api/runs/{run_id}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "run_in_use"
    msg = r.json()["error"]["message"]
    assert "a playground session is queued; stop it on the Playground page" in msg
    assert str(session.id) not in msg.replace(run_id, "")


def test_a_run_with_exports_in_progress_is_named_with_every_export(client, engine, settings):
    """Trial s22 F4: the refusal named the run by its id and only the first of its two
    queued exports. It names the run by its name and every export, the same on /api and
    the page."""
    run_id, job_id = _running_run(client, engine)
    _checkpoint(engine, settings, run_id, job_id, 2)
    _cancel(engine, job_id)
    _rename(engine, run_id, "alice-grpo2")
    ids = [client.post(f"/api/runs/{run_id}/exports", json={"format": f}).json()["id"]
           for f in ("adapter", "merged_16bit")]
    assert queue.claim(engine, "w-export", 30, kinds=["export"]).id == ids[0]
    msg = (f"run alice-grpo2 is in use: 2 exports in progress ({ids[0]} running, {ids[1]} "
           "queued); cancel them or wait until they end, then delete the run")
    r = client.delete(f"/api/runs/{run_id}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "run_in_use"
    assert r.json()["error"]["message"] == msg
    r = client.post(f"/runs/{run_id}/delete", headers={"HX-Request": "true"})
    assert r.status_code == 409 and str(escape(msg)) in r.text
    assert client.get(f"/api/runs/{run_id}").status_code == 200
    # one left: it alone is named
    assert queue.finish(engine, ids[0], "w-export", {})
    r = client.delete(f"/api/runs/{run_id}")
    assert r.status_code == 409 and r.json()["error"]["message"] == (
        f"run alice-grpo2 is in use: export {ids[1]} is queued; cancel it or wait until it "
        "ends, then delete the run")
