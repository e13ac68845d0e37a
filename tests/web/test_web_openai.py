"""The official openai client against /v1 on a real uvicorn server (no worker running)."""
from __future__ import annotations

import openai
import pytest

from app.store import events, queue, repo

from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations

FILES = sorted(p for sub in ("sft", "messy") if (SHARED / sub).is_dir()
               for p in (SHARED / sub).iterdir() if p.is_file())


@pytest.fixture
def oai(app, server, admin_key):
    """The openai client; its ``files.create`` returns once the upload is validated, as a user
    who polls ``files.retrieve`` until the status leaves ``uploaded`` would (no worker runs here:
    the validate job runs in this process)."""
    client = openai.OpenAI(base_url=server + "/v1", api_key=admin_key, max_retries=0, timeout=60)
    create = client.files.create

    def create_and_validate(**kw):
        f = create(**kw)
        assert f.status == "uploaded"  # returned at once; validated in the background
        run_validations(app)
        return client.files.retrieve(f.id)

    client.files.create = create_and_validate
    return client


def test_files_create_every_file(oai, settings):
    for path in FILES:
        with path.open("rb") as fh:
            f = oai.files.create(file=(path.name, fh), purpose="fine-tune")
        if f.status == "error":
            assert "row " in f.status_details, (path.name, f.status_details)
            continue
        assert f.id.startswith("file-") and f.filename == path.name and f.status == "processed"
        assert oai.files.retrieve(f.id).bytes == path.stat().st_size
    listed = oai.files.list()
    assert len(listed.data) >= 8
    leftovers = [p.name for p in (settings.data_dir / "uploads").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_files_errors_and_delete(oai, settings):
    big = b"x" * (settings.max_upload_mb * 1024 * 1024 + 1)
    with pytest.raises(openai.APIStatusError) as exc:
        oai.files.create(file=("big.txt", big), purpose="fine-tune")
    assert exc.value.status_code == 413 and "upload limit" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        oai.files.create(file=("a.jsonl", b'{"text": "hi"}\n'), purpose="assistants")
    assert exc.value.body["param"] == "purpose"
    f = oai.files.create(file=("a.jsonl", b'{"text": "hello world"}\n'), purpose="fine-tune")
    assert oai.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(f.id)


def test_fine_tuning_jobs(oai, engine):
    path = SHARED / "sft" / "oasst1_en_100_messages.jsonl"
    with path.open("rb") as fh:
        f = oai.files.create(file=(path.name, fh), purpose="fine-tune")
    job = oai.fine_tuning.jobs.create(
        model="stories260K", training_file=f.id,
        hyperparameters={"batch_size": 4, "learning_rate_multiplier": 0.5},
        extra_body={"r": 4, "lora_alpha": 8, "max_steps": 30, "target_modules": ["q_proj", "v_proj"]})
    assert job.id.startswith("ftjob-") and job.status == "queued" and job.model == "stories260K"
    spec = job.model_extra["whetstone"]["spec"]
    assert spec["num_train_epochs"] == 1 and spec["per_device_train_batch_size"] == 4
    assert spec["learning_rate"] == pytest.approx(1e-4) and spec["r"] == 4 and spec["max_steps"] == 30
    assert spec["target_modules"] == ["q_proj", "v_proj"]

    # n_epochs and max_steps both: max_steps would win and n_epochs read back as the epochs
    # its steps make (trial s22 F3: n_epochs 1 read back as 4); refused, naming both
    with pytest.raises(openai.BadRequestError) as bad:
        oai.fine_tuning.jobs.create(model="stories260K", training_file=f.id,
                                    hyperparameters={"n_epochs": 1}, extra_body={"max_steps": 40})
    assert bad.value.body["param"] == "hyperparameters.n_epochs"
    assert "give hyperparameters.n_epochs or max_steps, not both" in bad.value.body["message"]

    job2 = oai.fine_tuning.jobs.create(
        model="stories260K", training_file=f.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3}}})
    assert job2.method.supervised.hyperparameters.n_epochs == 3

    page = oai.fine_tuning.jobs.list(limit=1)
    assert len(page.data) == 1 and page.has_more
    ids = [j.id for j in oai.fine_tuning.jobs.list(limit=10).data]
    assert set(ids) == {job.id, job2.id}

    claimed = queue.claim(engine, "w", 60, kinds=["train"])
    assert claimed.run_id == job.id
    for step in (1, 2):
        events.append_many(engine, claimed.id, [("metric", {"step": step, "total_steps": 30,
                                                            "loss": 2.0 / step, "learning_rate": 1e-4})])
    assert oai.fine_tuning.jobs.retrieve(job.id).status == "running"
    evs = oai.fine_tuning.jobs.list_events(job.id, limit=10).data
    metrics = [e for e in evs if e.type == "metrics"]
    assert metrics[0].data["step"] == 2 and metrics[0].data["loss"] == 1.0
    assert metrics[0].data["learning_rate"] == 1e-4 and "Step 2/30" in metrics[0].message
    older = oai.fine_tuning.jobs.list_events(job.id, after=evs[0].id, limit=100).data
    assert [e.id for e in older] == [e.id for e in evs[1:]]

    assert oai.fine_tuning.jobs.checkpoints.list(job.id).data == []
    cancelled = oai.fine_tuning.jobs.cancel(job.id)
    assert cancelled.model_extra["whetstone"]["cancel_requested"] is True
    assert oai.fine_tuning.jobs.cancel(job2.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        oai.fine_tuning.jobs.cancel(job2.id)


def test_fine_tuning_errors(oai):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.fine_tuning.jobs.create(model="no-such-model", training_file="file-x")
    assert exc.value.body["param"] == "model" and exc.value.body["type"] == "invalid_request_error"
    f = oai.files.create(file=("a.jsonl", b'{"text": "hello world"}\n'), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError) as exc:
        oai.fine_tuning.jobs.create(model="stories260K", training_file="file-nope")
    assert exc.value.body["param"] == "training_file"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.fine_tuning.jobs.create(model="stories260K", training_file=f.id,
                                    hyperparameters={"batch_size": 0})
    assert exc.value.body["param"] == "hyperparameters.batch_size"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.fine_tuning.jobs.create(model="stories260K", training_file=f.id, extra_body={"rank": 8})
    assert "unknown parameter 'rank'" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oai.fine_tuning.jobs.retrieve("ftjob-missing")


def test_checkpoints_trained_tokens_epochs_and_limits(oai, engine, settings):
    """Checkpoints come from the run's checkpoints/checkpoint-N folders; a finished job reports
    its trained tokens; integral n_epochs is an int; list limits are 1..100."""
    import json

    f = oai.files.create(file=("a.jsonl", b'{"text": "hello world"}\n'), purpose="fine-tune")
    job = oai.fine_tuning.jobs.create(model="stories260K", training_file=f.id,
                                      hyperparameters={"n_epochs": 2})
    assert job.hyperparameters.n_epochs == 2 and isinstance(job.hyperparameters.n_epochs, int)
    assert job.trained_tokens is None
    ckpts = settings.data_dir / "runs" / job.id / "checkpoints"
    for step in (10, 20, 5):
        (ckpts / f"checkpoint-{step}").mkdir(parents=True)
    (ckpts / "checkpoint-20" / "trainer_state.json").write_text(json.dumps(
        {"log_history": [{"step": 10, "loss": 2.5}, {"step": 20, "loss": 1.25, "learning_rate": 1e-4}]}))
    (ckpts / "not-a-checkpoint").mkdir()
    listed = oai.fine_tuning.jobs.checkpoints.list(job.id)
    assert [c.step_number for c in listed.data] == [20, 10, 5]
    assert listed.data[0].metrics.train_loss == 1.25 and listed.data[0].metrics.step == 20
    assert listed.data[0].fine_tuned_model_checkpoint.endswith(":ckpt-step-20")
    page2 = oai.fine_tuning.jobs.checkpoints.list(job.id, after=listed.data[0].id, limit=1)
    assert [c.step_number for c in page2.data] == [10] and page2.has_more
    with pytest.raises(openai.NotFoundError) as exc:  # a deleted checkpoint: no silent restart
        oai.fine_tuning.jobs.checkpoints.list(job.id, after="ftckpt-nope")
    assert exc.value.body["param"] == "after"

    claimed = queue.claim(engine, "w", 60, kinds=["train"])
    assert queue.finish(engine, claimed.id, "w", {"tokens": 1234, "final_loss": 1.0})
    assert oai.fine_tuning.jobs.retrieve(job.id).trained_tokens == 1234

    for bad in (0, 101):
        with pytest.raises(openai.BadRequestError) as exc:
            oai.fine_tuning.jobs.list(limit=bad)
        assert exc.value.body["param"] == "limit"
    assert len(oai.fine_tuning.jobs.list(limit=100).data) == 1


def test_models_list_and_retrieve_fine_tuned_models(oai, engine):
    """GET /v1/models lists the base models and the fine_tuned_model of every succeeded job
    (not of queued or failed ones); GET /v1/models/{id} retrieves either kind."""
    f = oai.files.create(file=("a.jsonl", b'{"text": "hello world"}\n'), purpose="fine-tune")
    jobs = [oai.fine_tuning.jobs.create(model="stories260K", training_file=f.id, suffix=s)
            for s in ("ok", "bad", "waiting")]
    assert [m.id for m in oai.models.list().data] == ["stories260K"]
    for job, end in zip(jobs, ("finish", "fail")):
        claimed = queue.claim(engine, "w", 60, kinds=["train"])
        assert claimed.run_id == job.id
        if end == "finish":
            assert queue.finish(engine, claimed.id, "w", {"tokens": 10})
        else:
            assert queue.fail(engine, claimed.id, "w", "boom")
    done = oai.fine_tuning.jobs.retrieve(jobs[0].id)
    assert done.status == "succeeded" and done.fine_tuned_model == f"stories260K:ft:{jobs[0].id}"
    assert oai.fine_tuning.jobs.retrieve(jobs[1].id).fine_tuned_model is None
    finished_at = repo.run_with_job(engine, jobs[0].id)[1].finished_at

    listed = oai.models.list().data
    assert [m.id for m in listed] == ["stories260K", done.fine_tuned_model]
    ft = listed[1]
    assert (ft.object, ft.owned_by, ft.created) == ("model", "whetstone", int(finished_at))
    assert ft.created == done.finished_at
    assert listed[0].owned_by == "llama2c" and listed[0].object == "model"

    got = oai.models.retrieve(done.fine_tuned_model)
    assert got.model_dump(exclude_unset=True) == {
        "id": done.fine_tuned_model, "object": "model", "created": done.finished_at,
        "owned_by": "whetstone"}
    assert oai.models.retrieve("stories260K").owned_by == "llama2c"
    for missing in (f"stories260K:ft:{jobs[1].id}", f"stories260K:ft:{jobs[2].id}",
                    f"other:ft:{jobs[0].id}", "stories260K:ft:ftjob-nope", "nope"):
        with pytest.raises(openai.NotFoundError) as exc:
            oai.models.retrieve(missing)
        assert exc.value.body["param"] == "model" and exc.value.body["code"] == "model_not_found"
        assert repr(missing) in exc.value.body["message"]


def test_an_api_key_works_until_revoked(server, client):
    """The official client with a key from POST /api/keys lists files; once the key is revoked
    (DELETE /api/keys/{id}) the same client gets 401 in the OpenAI error shape."""
    made = client.post("/api/keys", json={"name": "laptop"})
    assert made.status_code == 201, made.text
    oai = openai.OpenAI(base_url=server + "/v1", api_key=made.json()["key"], max_retries=0,
                        timeout=30)
    assert oai.files.list().data == []
    assert client.delete(f"/api/keys/{made.json()['id']}").status_code == 204
    with pytest.raises(openai.AuthenticationError) as exc:
        oai.files.list()
    assert exc.value.status_code == 401
    assert exc.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wk-not-a-key", max_retries=0).models.list()


def test_the_readme_api_example_runs_as_written(app, server, admin_key):
    """The README's /v1 snippet, run as written (its URL, key and file swapped for this server's):
    the upload is validated in the background (here by a thread standing in for the worker)
    while ``files.wait_for_processing`` polls, then the job is accepted and lists its events."""
    import re
    import threading
    import time
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"### API.*?```python\n(.*?)```", readme, re.S).group(1)
    assert "wait_for_processing" in block
    code = (block.replace("http://127.0.0.1:8000/v1", server + "/v1")
            .replace('"wk-…"', repr(admin_key))
            .replace('"train.jsonl"', repr(str(SHARED / "sft" / "alpaca_en_demo.json"))))
    done = threading.Event()

    def worker():  # the validate_dataset job, once the upload has queued it
        while not done.is_set():
            if run_validations(app):
                return
            time.sleep(0.2)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    printed: list[str] = []
    scope = {"print": lambda *a: printed.append(" ".join(map(str, a)))}
    try:
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    finally:
        done.set()
        t.join(5)
    job = scope["job"]
    assert job.id.startswith("ftjob-") and job.status == "queued" and job.model == "stories260K"
    assert scope["f"].status == "processed"
    assert job.model_extra["whetstone"]["spec"]["max_steps"] == 60
    assert printed and any("queued" in m.lower() for m in printed), printed
