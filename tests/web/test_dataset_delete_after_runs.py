"""A dataset that finished runs trained on can be deleted (trial s25: "delete those runs first"
made a user delete trained runs, adapters and all, to free an upload). Only a queued or running
job of a run keeps it. Once deleted its file is gone and it is gone from every list and URL,
while the runs keep their record: their pages name it "(deleted)", a resume, a checkpoint
evaluation and a clone say why they need another. The worker is simulated through the store
(claim, artifacts, cancel), the channel it uses."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.store import queue, repo
from app.store.specs import TrainSpec
from tests.web.conftest import upload_sft
from tests.web.test_export_checkpoint import _cancel, _checkpoint
from worker.context import JobContext, JobError
from worker.jobs.common import job_inputs
from worker.progress import Reporter

MODEL = "model-stories260K"


def _ended_run(client, engine, settings, ds: str, name: str, **spec) -> str:
    """A run on ``ds`` that was cancelled after saving checkpoint-2 (resumable)."""
    run, job = repo.create_run(engine, TrainSpec(model=MODEL, dataset=ds, max_steps=10,
                                                 save_steps=2, **spec), name=name)
    assert queue.claim(engine, "w-test", 30, kinds=["train"]).id == job.id
    _checkpoint(engine, settings, run.id, job.id, 2)
    _cancel(engine, job.id)
    return run.id


def test_a_dataset_of_ended_runs_is_deleted_and_the_runs_keep_their_record(client, engine,
                                                                            settings) -> None:
    ds = upload_sft(client)
    held = upload_sft(client, "alpaca_en_demo.json")
    run_id = _ended_run(client, engine, settings, ds, "first", validation_split_percentage=10)
    val_run = _ended_run(client, engine, settings, held, "on-held", validation_file=ds)
    path = Path(repo.get_dataset(engine, ds).path)
    assert path.is_file()
    assert client.get(f"/api/runs/{run_id}").json()["resume"]["can_resume"] is True

    # a queued run on it keeps it; the message says until when
    queued, job = repo.create_run(engine, TrainSpec(model=MODEL, dataset=ds, max_steps=3),
                                  name="waiting")
    r = client.delete(f"/api/datasets/{ds}")
    assert r.status_code == 409 and r.json()["error"]["message"] == (
        "identity_alpaca.json is used by run waiting, whose training job is queued: delete it "
        "once that has ended (or cancel it)")
    queue.cancel(engine, job.id)
    # a checkpoint evaluation rebuilds the held-out set from it: it keeps it too, said so
    ev = queue.enqueue(engine, "evaluate", {"run_id": run_id, "checkpoint_step": 2},
                       run_id=run_id)
    r = client.delete(f"/api/datasets/{ds}")
    assert r.status_code == 409 and r.json()["error"]["message"] == (
        "identity_alpaca.json is used by run first, whose checkpoint evaluation is queued: "
        "delete it once that has ended (or cancel it)")
    queue.cancel(engine, ev.id)
    # an export or a playground session of a run does not read it (trial s27: they did hold it)
    for kind in ("export", "playground"):
        queue.enqueue(engine, kind, {"run_id": run_id}, run_id=run_id)

    r = client.delete(f"/api/datasets/{ds}")
    assert r.status_code == 200, r.text
    assert not path.exists()  # the upload is gone from the disk
    assert client.get(f"/api/datasets/{ds}").status_code == 404
    assert client.get(f"/datasets/{ds}").status_code == 404
    assert client.get(f"/v1/files/{ds}").status_code == 404
    assert client.delete(f"/api/datasets/{ds}").status_code == 404  # deleted once
    assert ds not in [d["id"] for d in client.get("/api/datasets").json()["data"]]
    assert ds not in [f["id"] for f in client.get("/v1/files").json()["data"]]
    assert ds not in client.get("/runs/new").text  # the run form does not offer it

    # the runs that used it keep their record, naming it deleted
    for rid in (run_id, queued.id):
        assert client.get(f"/api/runs/{rid}").status_code == 200
        assert "identity_alpaca.json (deleted)" in client.get(f"/runs/{rid}").text
    dash = client.get("/").text
    assert "identity_alpaca.json (deleted)" in dash
    # its validation job's row names it, with no link to a page that is gone (trial s27)
    assert f'href="/datasets/{ds}"' not in dash
    assert f'<a href="/datasets/{held}">alpaca_en_demo.json</a>' in dash
    # neither can resume, rebuild its held-out set or be cloned with it
    for rid, words in ((run_id, "first trains on dataset"),
                       (val_run, "on-held evaluates on validation_file")):
        why = f"run {words} identity_alpaca.json, which was deleted: clone it and pick another"
        info = client.get(f"/api/runs/{rid}").json()["resume"]
        assert (info["can_resume"], info["reason"]) == (False, why), info
        r = client.post(f"/api/runs/{rid}/resume")
        assert r.status_code == 409 and r.json()["error"]["message"] == why
    r = client.post(f"/api/runs/{run_id}/checkpoints/2/evaluations")
    assert r.status_code == 409 and r.json()["error"]["message"] == (
        "run first trains on dataset identity_alpaca.json, which was deleted; its held-out set "
        "cannot be rebuilt to evaluate a checkpoint")
    page = client.get(f"/runs/new?clone={run_id}").text
    assert ("The dataset identity_alpaca.json that run first used was deleted: pick another."
            in page)
    assert f'value="{ds}"' not in page
    # its held-out set is named as deleted on its page
    assert "validation_file identity_alpaca.json (deleted)" in client.get(f"/runs/{val_run}").text
    page = client.get(f"/runs/new?clone={val_run}").text
    assert ("The validation_file identity_alpaca.json that run on-held used was deleted: pick "
            "another, or none.") in page
    assert f'value="{ds}"' not in page and f'value="{held}" selected' in page

    # a dataset no run names goes entirely
    lone = upload_sft(client, "alpaca_en_demo.json")
    assert client.delete(f"/api/datasets/{lone}").status_code == 200
    with pytest.raises(repo.NotFound):  # no row stays of a dataset no run names
        repo.get_dataset(engine, lone, deleted=True)


def test_a_validation_that_ends_after_the_delete_does_not_bring_it_back(client, engine) -> None:
    ds = upload_sft(client)
    run, job = repo.create_run(engine, TrainSpec(model=MODEL, dataset=ds, max_steps=3))
    queue.cancel(engine, job.id)
    assert client.delete(f"/api/datasets/{ds}").status_code == 200
    with pytest.raises(repo.NotFound):
        repo.update_dataset(engine, ds, status="processed")
    assert client.get(f"/api/datasets/{ds}").status_code == 404


def test_a_job_that_meets_its_deleted_dataset_says_so(client, engine, settings) -> None:
    """A delete that races a resume's queueing: the job fails with the file's name, not a
    NotFound of an id."""
    ds = upload_sft(client)
    run, job = repo.create_run(engine, TrainSpec(model=MODEL, dataset=ds, max_steps=3))
    queue.cancel(engine, job.id)
    assert client.delete(f"/api/datasets/{ds}").status_code == 200
    repo.update_model(engine, MODEL, status="ready", path=str(settings.data_dir))
    ctx = JobContext(engine, settings, job, "w-test", Reporter(engine, job.id))
    with pytest.raises(JobError) as e:
        job_inputs(ctx, TrainSpec.model_validate(run.spec))
    assert str(e.value) == ("dataset identity_alpaca.json was deleted; clone the run and pick "
                            "another dataset")
