"""A trainer checkpoint downloads as one zip from the run page and through /api (trial defect):
the adapter and tokenizer files under ``checkpoint-<step>/``, the trainer's resume state only
with ``?state=true``, nothing written under the data dir, owner-only (another user's run is a
404), a rotated checkpoint a 404 naming it. The worker's side is simulated through the store
(claim, checkpoint artifacts) as in test_export_checkpoint; the files are real."""
from __future__ import annotations

import html
import io
import json
import os
import re
import shutil
import zipfile

from app.store import events, queue, repo
from app.store.schema import Artifact
from app.store.specs import TrainSpec
from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in, upload_sft

ADAPTER = {"adapter_model.safetensors": b"\x08\0\0\0\0\0\0\0{}      " + b"\1" * 4000,
           "adapter_config.json": json.dumps({"peft_type": "LORA",
                                              "base_model_name_or_path": "stories260K"}).encode(),
           "tokenizer.json": b'{"model": {}}', "tokenizer_config.json": b"{}",
           "special_tokens_map.json": b"{}", "README.md": b"# checkpoint"}
STATE = {"optimizer.pt": b"o" * 9000, "scheduler.pt": b"s" * 100, "rng_state.pth": b"r" * 50,
         "trainer_state.json": b'{"global_step": 4}', "training_args.bin": b"t" * 10}


#: What PEFT writes into a checkpoint: its model card and config name the folder the base was
#: loaded from (a server path under the data dir); the download names the base's public id.
LEAKY = {"README.md": "---\nbase_model: {base}\nlibrary_name: peft\ntags:\n"
                      "- base_model:adapter:{base}\n- lora\n---\n\n# Model Card\n",
         "adapter_config.json": json.dumps({"peft_type": "LORA",
                                            "base_model_name_or_path": "{base}"}),
         "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
         "notes.txt": "saved from {base}/model.safetensors", "extra.yaml": "base: '{base}'\n"}


def _text_of(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("json", "md", "txt", "jinja", "yaml", "yml")


def _run_with_checkpoints(client, engine, settings, steps=(2, 4), leaky=False) -> str:
    ds = upload_sft(client)
    model = client.get("/api/models").json()["data"][0]["id"]
    run, job = repo.create_run(engine, TrainSpec(model=model, dataset=ds, max_steps=10,
                                                 save_steps=2), name="Tiny Stories run")
    assert queue.claim(engine, "w-test", 30, kinds=["train"]).id == job.id
    for step in steps:
        folder = settings.data_dir / "runs" / run.id / "checkpoints" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        for name, data in {**ADAPTER, **STATE}.items():
            (folder / name).write_bytes(data)
        if leaky:
            base = str(settings.data_dir / "models" / "stories260K")
            for name, text in LEAKY.items():
                (folder / name).write_text(text.replace("{base}", base), encoding="utf-8")
        repo.add_artifact(engine, Artifact(run_id=run.id, job_id=job.id, kind="checkpoint",
                                           name=folder.name, path=str(folder),
                                           meta={"step": step}))
    return run.id


def _tree(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def test_checkpoint_downloads_as_one_zip_from_page_and_api(client, engine, settings):
    run_id = _run_with_checkpoints(client, engine, settings)
    before = _tree(settings.data_dir)

    page = client.get(f"/runs/{run_id}").text
    assert f'href="/runs/{run_id}/checkpoints/4/download"' in page
    assert f'href="/runs/{run_id}/checkpoints/4/download?state=true"' in page
    arts = client.get(f"/api/runs/{run_id}").json()["artifacts"]
    ck = {a["meta"]["step"]: a for a in arts if a["kind"] == "checkpoint"}
    assert ck[4]["download_url"] == f"/api/runs/{run_id}/checkpoints/4/download"
    assert "path" not in ck[4]

    for url in (f"/runs/{run_id}/checkpoints/4/download", ck[4]["download_url"]):
        r = client.get(url)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/zip"
        assert r.headers["content-disposition"] == \
            'attachment; filename="tiny-stories-run-checkpoint-4.zip"'
        z = zipfile.ZipFile(io.BytesIO(r.content))
        assert z.testzip() is None
        assert sorted(z.namelist()) == sorted(f"checkpoint-4/{n}" for n in ADAPTER)
        for name, data in ADAPTER.items():
            assert z.read(f"checkpoint-4/{name}") == data
        assert not any(os.path.isabs(n) or ".." in n or str(settings.data_dir) in n
                       for n in z.namelist())

    r = client.get(f"/api/runs/{run_id}/checkpoints/2/download", params={"state": "true"})
    assert r.status_code == 200
    assert 'filename="tiny-stories-run-checkpoint-2-with-state.zip"' in \
        r.headers["content-disposition"]
    z = zipfile.ZipFile(io.BytesIO(r.content))
    # training_args.bin (pickled TrainingArguments: server paths) is not read on resume
    assert sorted(z.namelist()) == sorted(f"checkpoint-2/{n}" for n in {**ADAPTER, **STATE}
                                          if n != "training_args.bin")
    assert z.read("checkpoint-2/optimizer.pt") == STATE["optimizer.pt"]
    # built on the fly: nothing was written under the data dir (the audit log is in the db)
    assert {p for p in _tree(settings.data_dir) - before if not p.startswith("whetstone.db")} \
        == set()


def test_rotated_or_unknown_checkpoint_is_404_naming_it(client, engine, settings):
    run_id = _run_with_checkpoints(client, engine, settings)
    shutil.rmtree(settings.data_dir / "runs" / run_id / "checkpoints" / "checkpoint-2")
    for step in (2, 3):
        r = client.get(f"/api/runs/{run_id}/checkpoints/{step}/download")
        assert r.status_code == 404
        msg = r.json()["error"]["message"]
        assert msg.startswith(f"run {run_id} has no checkpoint at step {step} on disk: ")
        assert "save_total_limit" in msg and str(settings.data_dir) not in msg
        assert msg.endswith("(checkpoints on disk: 4)")
        r = client.get(f"/runs/{run_id}/checkpoints/{step}/download")
        assert r.status_code == 404 and f"has no checkpoint at step {step} on disk" in r.text
    page = client.get(f"/runs/{run_id}").text
    assert f"/runs/{run_id}/checkpoints/4/download" in page
    assert f"/runs/{run_id}/checkpoints/2/download" not in page
    for bad in ("-1", "abc", "2.5"):
        for url in (f"/api/runs/{run_id}/checkpoints/{bad}/download",
                    f"/runs/{run_id}/checkpoints/{bad}/download"):
            r = client.get(url)
            assert r.status_code == 422, (url, r.status_code)
            assert f"step '{bad}' is not a checkpoint step" in html.unescape(r.text)
            assert "not on disk" not in r.text


def test_a_step_not_reached_is_not_called_removed(client, engine, settings):
    """Trial-break F5: a step the run has not reached was said to be "removed by
    save_total_limit". The words follow the run's step (its newest metric or checkpoint) and
    its last step, the same on the page and /api downloads and a checkpoint export."""
    run_id = _run_with_checkpoints(client, engine, settings)  # max_steps 10, save_steps 2
    _, job = repo.run_with_job(engine, run_id)
    events.append_many(engine, job.id, [("metric", {"step": 5, "total_steps": 10, "loss": 3.0})])

    def says(step: int) -> str:
        r = client.get(f"/api/runs/{run_id}/checkpoints/{step}/download")
        assert r.status_code == 404
        msg = r.json()["error"]["message"]
        page = client.get(f"/runs/{run_id}/checkpoints/{step}/download")
        assert page.status_code == 404 and html.escape(msg) in page.text
        assert msg.endswith("(checkpoints on disk: 4, 2)"), msg
        return msg.split(" on disk: ", 1)[1]

    assert says(8).startswith("the run has not reached step 8 yet (it is at step 5)")
    assert says(12).startswith("the run trains 10 steps, so it never reaches step 12")
    assert "save_total_limit" in says(3)  # an older step: not saved, or rotated away
    queue.cancel(engine, job.id)
    queue.acknowledge_cancel(engine, job.id, "w-test")
    assert says(8).startswith("the run was cancelled at step 5, before it reached step 8")
    r = client.post(f"/api/runs/{run_id}/exports",
                    json={"format": "adapter", "checkpoint_step": 8})
    assert r.status_code == 422
    assert r.json()["error"]["message"].endswith(
        "the run was cancelled at step 5, before it reached step 8 (checkpoints on disk: 4, 2)")
    assert "save_total_limit" not in r.text


def test_checkpoint_text_files_name_no_server_path(client, engine, settings):
    """PEFT's model card (``base_model: <folder>``, tag ``base_model:adapter:<folder>``) and
    every other text file of the zip, with and without state, name the base's public id."""
    run_id = _run_with_checkpoints(client, engine, settings, steps=(2,), leaky=True)
    for params in ({}, {"state": "true"}):
        r = client.get(f"/api/runs/{run_id}/checkpoints/2/download", params=params)
        assert r.status_code == 200
        z = zipfile.ZipFile(io.BytesIO(r.content))
        assert z.testzip() is None
        texts = {n: z.read(n).decode() for n in z.namelist() if _text_of(n)}
        assert len(texts) == 8 + len(params), sorted(texts)  # + trainer_state.json
        for name, text in texts.items():
            assert str(settings.data_dir) not in text and os.path.realpath(
                settings.data_dir) not in text, name
            assert not re.search(r"(?<![\w.])/(tmp|home|work|data|var|srv)/", text), (name, text)
        card = texts["checkpoint-2/README.md"]
        assert card.startswith("---\nbase_model: stories260K\n")
        assert "- base_model:adapter:stories260K\n" in card
        assert json.loads(texts["checkpoint-2/adapter_config.json"])[
            "base_model_name_or_path"] == "stories260K"
        assert texts["checkpoint-2/notes.txt"] == "saved from stories260K"
        assert texts["checkpoint-2/chat_template.jinja"] == \
            "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_another_users_checkpoint_is_404(client, app, engine, settings):
    run_id = _run_with_checkpoints(client, engine, settings, steps=(2,))
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    accounts.create_user(engine, "bea", "bea-password-1", actor=admin)
    with signed_in(app, "bea", "bea-password-1") as bea:
        for url in (f"/api/runs/{run_id}/checkpoints/2/download",
                    f"/runs/{run_id}/checkpoints/2/download"):
            r = bea.get(url)
            assert r.status_code == 404, url
            assert b"PK" not in r.content[:2]

