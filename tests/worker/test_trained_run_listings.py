"""What users see of a real trained run (stories260K on the CPU, the real ``train`` job in an
in-process worker loop, everything read over HTTP, /v1 with the openai client): checkpoints the
trainer rotated away (``save_total_limit=2``) are no longer listed, no /api or /v1 answer shows
a server path, every checkpoint id chat accepts is a model GET /v1/models/{id} knows, a bad
``after`` cursor is an error naming it, and ``n_epochs`` is the epochs a max_steps run does.
"""
from __future__ import annotations

import io
import json
import zipfile

import openai
import pytest

from app.store import repo
from app.store.schema import JobState
from tests.conftest import SHARED_DATA, STORIES
from tests.worker.conftest import inline_studio

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (STORIES / "stories260K.bin").exists(),
                                 reason=f"no test data at {SHARED_DATA}")]

IDENTITY = SHARED_DATA / "sft" / "identity_alpaca.json"
#: 8 rows at batch 4: 2 steps an epoch, so 5 steps are 3 epochs; a checkpoint every step, the
#: trainer keeps the newest 2.
SPEC = {"model": "stories260K", "max_steps": 5, "save_steps": 1, "logging_steps": 1,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "r": 4,
        "lora_alpha": 8, "max_seq_length": 96, "chat_template": "chatml", "seed": 3}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("listings")
    rows = d / "identity8.json"
    rows.write_text(json.dumps(json.loads(IDENTITY.read_text())[:8]))
    with inline_studio(d / "data", [rows], "w-listings") as studio:
        c = studio["client"]
        r = c.post("/api/runs", json={**SPEC, "dataset": studio["ids"][rows.name]})
        assert r.status_code == 201, r.text
        studio["worker"].serve(once=True)
        run = c.get(f"/api/runs/{r.json()['id']}").json()
        assert run["state"] == JobState.SUCCEEDED, run
        oai = openai.OpenAI(base_url=f"{c.base_url}/v1", http_client=c, max_retries=0,
                            api_key=c.headers["Authorization"].removeprefix("Bearer "))
        yield {**studio, "run": run, "data_dir": d / "data", "oai": oai,
               "file": studio["ids"][rows.name]}


def test_rotated_checkpoints_are_not_listed(trained):
    c, run, eng = trained["client"], trained["run"], trained["engine"]
    folder = trained["data_dir"] / "runs" / run["id"] / "checkpoints"
    assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]
    ckpts = [a for a in run["artifacts"] if a["kind"] == "checkpoint"]
    assert sorted(a["name"] for a in ckpts) == ["checkpoint-4", "checkpoint-5"]
    assert sorted(a.meta["step"] for a in repo.list_artifacts(eng, run["id"], "checkpoint")) \
        == [4, 5]  # the rows of checkpoint-1 to -3 were deleted when the trainer removed them
    for a in ckpts:  # a folder: served as one zip of its adapter files, built as it is sent
        step = a["meta"]["step"]
        assert a["download_url"] == f"/api/runs/{run['id']}/checkpoints/{step}/download"
        z = zipfile.ZipFile(io.BytesIO(c.get(a["download_url"]).content))
        names = z.namelist()
        config = json.loads(z.read(f"checkpoint-{step}/adapter_config.json"))
        assert not config["base_model_name_or_path"].startswith(("/", "~")), config
        # PEFT's model card: the worker rewrote it on disk as it rewrote the config (trial: it
        # said base_model: <data dir>/models/stories260K)
        card = (folder / f"checkpoint-{step}" / "README.md").read_text()
        assert card.startswith("---\nbase_model: stories260K\n"), card[:200]
        assert "base_model:adapter:stories260K" in card
        for n in names:
            if n.endswith((".json", ".md", ".txt", ".jinja", ".yaml")):
                assert str(trained["data_dir"]) not in z.read(n).decode(), n
        assert f"checkpoint-{step}/adapter_model.safetensors" in names
        assert f"checkpoint-{step}/adapter_config.json" in names
        assert not any(n.endswith(("optimizer.pt", "scheduler.pt", ".pth")) for n in names)
    for a in run["artifacts"]:
        if a["download_url"]:
            assert c.get(a["download_url"]).status_code == 200, a
    listed = c.get(f"/v1/fine_tuning/jobs/{run['id']}/checkpoints").json()["data"]
    assert [x["step_number"] for x in listed] == [5, 4]


def test_no_server_path_in_api_or_v1_answers(trained):
    c, run = trained["client"], trained["run"]
    adapter = next(a for a in run["artifacts"] if a["kind"] == "adapter")
    assert adapter["meta"] == {"format": "peft"} and "path" not in adapter
    assert repo.get_artifact(trained["engine"], adapter["id"]).meta["folder"].endswith("adapter")
    root = str(trained["data_dir"].resolve())
    for url in (f"/api/runs/{run['id']}", "/api/runs", f"/v1/fine_tuning/jobs/{run['id']}",
                f"/v1/fine_tuning/jobs/{run['id']}/checkpoints", f"/v1/files/{adapter['id']}"):
        r = c.get(url)
        assert r.status_code == 200 and root not in r.text, (url, r.text[:2000])


def test_every_checkpoint_model_id_is_a_model(trained):
    oai, run = trained["oai"], trained["run"]
    job = oai.fine_tuning.jobs.retrieve(run["id"])
    ids = [c.fine_tuned_model_checkpoint
           for c in oai.fine_tuning.jobs.checkpoints.list(run["id"]).data]
    assert ids == [f"{job.fine_tuned_model}:ckpt-step-{s}" for s in (5, 4)]
    for model_id in (*ids, job.fine_tuned_model, f"{job.fine_tuned_model}:checkpoint-4"):
        got = oai.models.retrieve(model_id)
        assert (got.id, got.owned_by, got.object) == (model_id, "whetstone", "model")
    for missing in (f"{job.fine_tuned_model}:ckpt-step-1",   # rotated away
                    f"{job.fine_tuned_model}:ckpt-step-x", f"{job.fine_tuned_model}:art-nope"):
        with pytest.raises(openai.NotFoundError) as exc:
            oai.models.retrieve(missing)
        assert exc.value.body["param"] == "model" and exc.value.body["code"] == "model_not_found"


def test_list_after_an_unknown_job_is_an_error(trained):
    oai, run = trained["oai"], trained["run"]
    with pytest.raises(openai.NotFoundError) as exc:
        oai.fine_tuning.jobs.list(after="ftjob-nope")
    assert exc.value.body["param"] == "after" and "ftjob-nope" in exc.value.body["message"]
    assert exc.value.body["type"] == "invalid_request_error"
    assert [j.id for j in oai.fine_tuning.jobs.list().data][-1] == run["id"]
    assert oai.fine_tuning.jobs.list(after=run["id"]).data == []
    r = trained["client"].get("/api/runs", params={"after": "ftjob-nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "after"


def test_n_epochs_is_what_a_max_steps_run_does(trained):
    oai, run = trained["oai"], trained["run"]
    done = oai.fine_tuning.jobs.retrieve(run["id"])  # 5 steps of 2 an epoch, as trained
    assert done.hyperparameters.n_epochs == 3 == done.method.supervised.hyperparameters.n_epochs
    # planned from the dataset before training: 8 rows less 25% held out = 6, at batch 2 with
    # no accumulation 3 steps an epoch: 7 steps are 3 epochs (without the hold-out: 2)
    queued = oai.fine_tuning.jobs.create(
        model="stories260K", training_file=trained["file"], hyperparameters={"batch_size": 2},
        extra_body={"max_steps": 7, "gradient_accumulation_steps": 1,
                    "validation_split_percentage": 25})
    assert queued.status == "queued" and queued.hyperparameters.n_epochs == 3
    whole = oai.fine_tuning.jobs.create(model="stories260K", training_file=trained["file"],
                                        hyperparameters={"n_epochs": 2})
    assert whole.hyperparameters.n_epochs == 2  # no max_steps: the epochs asked for
    packed = oai.fine_tuning.jobs.create(model="stories260K", training_file=trained["file"],
                                         extra_body={"max_steps": 7, "packing": True})
    assert packed.hyperparameters.n_epochs == "auto"  # packing: the sequence count is unknown
    for j in (queued, whole, packed):
        oai.fine_tuning.jobs.cancel(j.id)
