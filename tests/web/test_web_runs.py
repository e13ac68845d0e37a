"""Run form validation, run creation, the SSE stream with resume, cancel and downloads."""
from __future__ import annotations

import json
import re

from app.store import events, queue, repo
from app.store.schema import Artifact

from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import run_validations


def _upload(client, name="alpaca_en_demo.json", validate: bool = True) -> str:
    path = SHARED / "sft" / name
    with path.open("rb") as fh:
        r = client.post("/datasets", files={"file": (path.name, fh)}, follow_redirects=False)
    if validate:
        run_validations(client.app)
    return r.headers["location"].rsplit("/", 1)[1]


def _form(client, ds_id, **over):
    model = client.get("/api/models").json()["data"][0]["id"]
    data = {"model": model, "dataset": ds_id, "r": "8", "lora_alpha": "16", "lora_dropout": "0",
            "max_seq_length": "256", "learning_rate": "2e-4", "num_train_epochs": "1",
            "max_steps": "30", "per_device_train_batch_size": "2", "gradient_accumulation_steps": "1",
            "warmup_ratio": "0", "lr_scheduler_type": "linear", "seed": "1",
            "train_on_responses_only": "true", "chat_template_choice": "chatml",
            "target_modules": ["q_proj", "v_proj"]}
    data.update(over)
    return data


def test_run_form_validation_errors_show_next_to_fields(client):
    ds = _upload(client)
    r = client.post("/runs", data=_form(client, ds, r="0", learning_rate="abc", max_steps="0",
                                        target_modules=[], lr_scheduler_type="sideways"))
    assert r.status_code == 422
    html = r.text
    assert "Please fix the fields marked below." in html and "Traceback" not in html
    for msg in ("must be from 1 to 1,024, not &#39;0&#39;",
                "must be a number from 1e-08 to 1, not &#39;abc&#39;", "must be one of linear",
                "name at least one module, e.g. q_proj"):
        assert msg in html, msg
    assert html.count('class="field-error"') >= 4
    r = client.post("/runs", data=_form(client, ds, max_steps="0"))
    assert r.status_code == 422 and "max_steps must be -1" in r.text
    r = client.post("/runs", data=_form(client, "file-missing"), headers={"HX-Request": "true"})
    assert r.status_code == 422 and "no dataset with id" in r.text and "<html" not in r.text


def test_create_run_and_page(client, engine):
    ds = _upload(client)
    r = client.post("/runs", data=_form(client, ds, name="first"), follow_redirects=False)
    assert r.status_code == 303
    run_id = r.headers["location"].rsplit("/", 1)[1]
    run = repo.get_run(engine, run_id)
    assert run.spec["r"] == 8 and run.spec["max_steps"] == 30
    assert run.spec["target_modules"] == ["q_proj", "v_proj"]
    assert run.spec["packing"] is False and run.spec["padding_free"] is False  # unticked boxes
    assert "<|im_start|>" in run.spec["chat_template"]  # the chosen default is saved in full
    r = client.post("/runs", data=_form(client, ds, padding_free="true"), follow_redirects=False)
    assert repo.get_run(engine, r.headers["location"].rsplit("/", 1)[1]).spec["padding_free"] is True
    form = client.get("/runs/new").text  # padding-free batches are the default: ticked
    assert re.search(r'<input type="checkbox" name="padding_free" value="true" checked>', form)
    page = client.get(f"/runs/{run_id}")
    assert page.status_code == 200 and "loss-chart" in page.text and "Cancel" in page.text
    assert run_id in client.get("/").text
    api = client.get(f"/api/runs/{run_id}").json()
    assert api["state"] == "queued" and api["metrics"]["count"] == 0


def test_api_create_run_errors(client):
    ds = _upload(client)
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "r": -1})
    assert r.status_code == 422 and r.json()["error"]["param"] == "r"
    r = client.post("/api/runs", json={"model": "nope", "dataset": ds})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 5})
    assert r.status_code == 201 and r.json()["spec"]["max_steps"] == 5


def _sse(text: str) -> list[dict]:
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        ev = {}
        for line in block.split("\n"):
            if ":" in line and not line.startswith(":"):
                k, v = line.split(":", 1)
                ev[k] = v.strip()
        if ev:
            out.append(ev)
    return out


def _start_run(client, engine):
    ds = _upload(client)
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 3})
    run_id = r.json()["id"]
    job = queue.claim(engine, "test-worker", 60, kinds=["train"])
    assert job is not None and job.run_id == run_id
    return run_id, job


def test_sse_streams_until_final_and_resumes(client, engine, settings):
    run_id, job = _start_run(client, engine)
    for step in (1, 2, 3):
        events.append_many(engine, job.id, [
            ("metric", {"step": step, "total_steps": 3, "loss": 3.0 - step * 0.5,
                        "learning_rate": 1e-4, "grad_norm": 1.0, "tokens_per_second": 100.0,
                        "eta_seconds": 3 - step, "memory_gib": 0.1, "memory_kind": "rss"}),
            ("log", {"level": "info", "message": f"step {step} done"})])
    run_dir = settings.data_dir / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"r": 8}))
    repo.add_artifact(engine, Artifact(run_id=run_id, job_id=job.id, kind="config", name="config.json",
                                       path=str(run_dir / "config.json"), bytes=7))
    assert queue.finish(engine, job.id, "test-worker", result={"trained_tokens": 123})

    with client.stream("GET", f"/runs/{run_id}/events") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        full = _sse("".join(r.iter_text()))
    kinds = [e.get("event") for e in full]
    assert kinds[-1] == "end" and kinds.count("metric") == 3 and "log" in kinds
    assert json.loads(full[-1]["data"])["state"] == "succeeded"
    ids = [int(e["id"]) for e in full if "id" in e]
    assert ids == sorted(ids)
    metric = json.loads(next(e for e in full if e.get("event") == "metric")["data"])
    assert metric["step"] == 1 and metric["loss"] == 2.5

    cut = ids[3]
    with client.stream("GET", f"/runs/{run_id}/events", headers={"Last-Event-ID": str(cut)}) as r:
        resumed = _sse("".join(r.iter_text()))
    assert [int(e["id"]) for e in resumed if "id" in e] == [i for i in ids if i > cut]
    with client.stream("GET", f"/runs/{run_id}/events?after={ids[-2]}") as r:
        tail = _sse("".join(r.iter_text()))
    assert [int(e["id"]) for e in tail if "id" in e] == [ids[-1]]

    arts = client.get(f"/api/runs/{run_id}").json()["artifacts"]
    dl = client.get(arts[0]["download_url"])
    assert dl.status_code == 200 and dl.json() == {"r": 8}
    page = client.get(f"/runs/{run_id}", headers={"HX-Request": "true", "HX-Target": "artifacts"})
    assert "config.json" in page.text and "<html" not in page.text


def test_download_refuses_paths_outside_data_dir(client, engine, tmp_path):
    run_id, job = _start_run(client, engine)
    outside = tmp_path / "secret.txt"
    outside.write_text("no")
    art = repo.add_artifact(engine, Artifact(run_id=run_id, kind="config", name="x", path=str(outside)))
    assert client.get(f"/artifacts/{art.id}/download").status_code == 404


def test_cancel_queued_and_running(client, engine):
    ds = _upload(client)
    queued = client.post("/api/runs", json={"model": "stories260K", "dataset": ds}).json()["id"]
    r = client.post(f"/runs/{queued}/cancel", follow_redirects=False)
    assert r.status_code == 303
    assert client.get(f"/api/runs/{queued}").json()["state"] == "cancelled"

    run_id, job = _start_run(client, engine)
    r = client.post(f"/runs/{run_id}/cancel", headers={"HX-Request": "true"})
    assert r.status_code == 200 and "Cancelling" in r.text and "<html" not in r.text
    assert queue.heartbeat(engine, job.id, "test-worker", 60).cancel_requested
    assert queue.acknowledge_cancel(engine, job.id, "test-worker")
    with client.stream("GET", f"/runs/{run_id}/events") as r:
        evs = _sse("".join(r.iter_text()))
    assert json.loads(evs[-1]["data"])["state"] == "cancelled"
    # an ended run: /api says so (409) and the audit log records no cancel that did not happen
    from app.studio import audit

    before = [e for e in audit.recent(engine) if e.action == "run.cancelled"]
    r = client.post(f"/api/runs/{run_id}/cancel")
    assert r.status_code == 409 and "already cancelled" in r.json()["error"]["message"]
    assert [e for e in audit.recent(engine) if e.action == "run.cancelled"] == before


def test_chat_template_is_checked_when_the_run_is_created(client):
    """A template that raises or does not parse is refused at submit, with its own message."""
    ds = _upload(client)
    raising = ("{% for m in messages %}{% if m.role == 'assistant' %}"
               "{{ raise_exception('Assistant turns are not supported here') }}{% endif %}"
               "{{ m.content }}{% endfor %}")
    r = client.post("/runs", data=_form(client, ds, chat_template=raising),
                    headers={"HX-Request": "true"})
    assert r.status_code == 422
    assert re.search(r'<textarea name="chat_template".*?</textarea>\s*<span class="field-error" '
                     r'role="alert">[^<]*Assistant turns are not supported here', r.text, re.S)
    broken = "{% for m in messages %}\n{{ m.content }\n{% endfor %}"
    r = client.post("/runs", data=_form(client, ds, chat_template=broken))
    assert r.status_code == 422 and "does not parse: line 2" in r.text
    # a template that only refuses a system turn is fine for chats without one
    no_system = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system') }}{% endif %}"
                 "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    r = client.post("/runs", data=_form(client, ds, chat_template=no_system), follow_redirects=False)
    assert r.status_code == 303
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "chat_template": broken})
    assert r.status_code == 422 and r.json()["error"]["param"] == "chat_template"
    assert "line 2" in r.json()["error"]["message"]
    r = client.post("/v1/fine_tuning/jobs", json={"model": "stories260K", "training_file": ds,
                                                  "chat_template": raising})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "chat_template" and err["code"] == "invalid_value"
    assert "Assistant turns are not supported here" in err["message"]
    r = client.post("/v1/fine_tuning/jobs", json={"model": "stories260K", "training_file": ds,
                                                  "suffix": "x" * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "chat_template": "llama3"})
    assert r.status_code == 201
    # a template that writes no message content would train nothing
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "chat_template": "hello"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "chat_template"
    assert "does not write the user and assistant messages" in r.json()["error"]["message"]


def test_qlora_is_refused_at_creation_when_every_live_worker_has_no_cuda(client, engine):
    """load_in_4bit with only CPU workers live is a field error on load_in_4bit (form, /api,
    /v1); with no live worker, or with a live CUDA worker, the run is queued."""
    from app.store import workers
    from app.store.db import session_scope
    from app.store.schema import Worker, now

    ds = _upload(client)
    qlora = {"model": "stories260K", "dataset": ds, "load_in_4bit": True}
    r = client.post("/api/runs", json=qlora)  # no worker yet: a GPU worker may start later
    assert r.status_code == 201 and r.json()["spec"]["load_in_4bit"] is True

    workers.register(engine, "w-cpu", "box", 11, "cpu (16 cores, x86_64)")
    workers.register(engine, "w-gpu-dead", "box", 12, "cuda:0 NVIDIA H200")
    with session_scope(engine) as s:  # last seen an hour ago: not live
        w = s.get(Worker, "w-gpu-dead")
        w.last_seen = now() - 3600
        s.add(w)
    why = ("QLoRA (load_in_4bit) needs a CUDA GPU, and no live worker has one (workers run on: "
           "cpu (16 cores, x86_64)). Turn load_in_4bit off")
    r = client.post("/runs", data=_form(client, ds, load_in_4bit="true"),
                    headers={"HX-Request": "true"})
    assert r.status_code == 422 and "<html" not in r.text
    assert re.search(r'name="load_in_4bit"[^>]*checked>.*?</label>\s*<span class="field-error" '
                     r'role="alert">' + re.escape(why), r.text, re.S)
    r = client.post("/api/runs", json=qlora)
    assert r.status_code == 422 and r.json()["error"]["param"] == "load_in_4bit"
    assert r.json()["error"]["message"].startswith(why)
    r = client.post("/v1/fine_tuning/jobs", json={"model": "stories260K", "training_file": ds,
                                                  "load_in_4bit": True})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "load_in_4bit"
    assert err["code"] == "invalid_value" and err["message"].startswith(why)
    r = client.post("/api/runs", json={**qlora, "load_in_4bit": False})  # LoRA still fine
    assert r.status_code == 201

    workers.touch(engine, "w-gpu-dead", None)  # the GPU worker is back
    r = client.post("/api/runs", json=qlora)
    assert r.status_code == 201 and r.json()["spec"]["load_in_4bit"] is True
    assert len(client.get("/api/runs").json()["data"]) == 3


def test_run_on_a_dataset_still_validating_is_a_field_error(client):
    """The upload returns while the file is validated in the background; a run on it meanwhile
    is refused on the ``dataset`` field with how far validation got, on every surface."""
    ds_id = _upload(client, validate=False)
    assert client.get(f"/api/datasets/{ds_id}").json()["status"] == "validating"
    r = client.post("/runs", data=_form(client, ds_id))
    assert r.status_code == 422
    assert "still validating, 0/? rows" in r.text
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds_id, "max_steps": 1})
    assert r.status_code == 422, r.text
    err = r.json()
    assert "still validating" in json.dumps(err) and "dataset" in json.dumps(err)
    assert client.get("/v1/files/" + ds_id).json()["status"] == "uploaded"
    run_validations(client.app)
    assert client.get("/v1/files/" + ds_id).json()["status"] == "processed"
    r = client.post("/runs", data=_form(client, ds_id), follow_redirects=False)
    assert r.status_code == 303, r.text[:300]


def test_run_names_are_bounded_and_printable(client, settings):
    """A 100k-character name or one with NUL / a right-to-left override is a name field error on
    every surface; a plain name is trimmed and kept."""
    from tests.web.conftest import run_validations

    with (settings.seed_dir / "sft" / "alpaca_en_demo.json").open("rb") as fh:
        ds = client.post("/v1/files", files={"file": ("a.json", fh)},
                         data={"purpose": "fine-tune"}).json()["id"]
    assert run_validations(client.app) == 1
    for bad, why in (("x" * 100_000, "at most 100 characters"),
                     ("\u0000nul\u202eRTL", "U+0000, U+202E")):
        r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "name": bad})
        assert r.status_code == 422 and r.json()["error"]["param"] == "name", r.text[:300]
        assert why in r.json()["error"]["message"]
        r = client.post("/api/runs/grpo", json={"model": "stories260K", "dataset": ds, "name": bad,
                                                "rewards": [{"name": "format"}]})
        assert r.status_code == 422 and r.json()["error"]["param"] == "name"
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds,
                                       "name": "  nightly alpaca  "})
    assert r.status_code == 201 and r.json()["name"] == "nightly alpaca"


def test_cleared_learning_rate_is_a_field_error_not_the_default(client):
    """Issue 19 (Low): clearing Learning rate used 2e-4 silently; now the field says so."""
    ds = _upload(client)
    r = client.post("/runs", data=_form(client, ds, learning_rate="", r=" "))
    assert r.status_code == 422
    assert re.search(r"enter a value \(the default is 0\.0002\)", r.text)
    assert "enter a value (the default is 16)" in r.text  # r
    assert client.get("/api/runs").json()["data"] == []
    r = client.post("/runs", data=_form(client, ds, max_steps=""), follow_redirects=False)
    assert r.status_code == 303  # an empty max_steps still means "use num_train_epochs"


def test_dataset_pickers_tell_files_apart_and_grpo_lists_prompts(client):
    """Issue 19 item 16: two train.jsonl files differ by kind, rows, date and id; the GRPO
    picker lists prompt datasets only (unless the form already names another)."""
    sft = (SHARED / "sft" / "identity_alpaca.json").read_bytes()
    gsm = "\n".join((SHARED / "grpo" / "gsm8k" / "train.jsonl").read_text().splitlines()[:30])
    a = client.post("/datasets", files={"file": ("train.jsonl", sft)}, follow_redirects=False)
    b = client.post("/grpo/datasets", files={"file": ("train.jsonl", gsm.encode())},
                    follow_redirects=False)
    run_validations(client.app)
    a_id = a.headers["location"].rsplit("/", 1)[1]
    b_id = b.headers["location"].rsplit("/", 1)[1]
    form = client.get("/runs/new").text
    opt = re.search(rf'<option value="{a_id}"[^>]*>([^<]*)</option>', form).group(1)
    assert re.fullmatch(rf"train\.jsonl — SFT alpaca, 91 rows, \d{{4}}-\d\d-\d\d \d\d:\d\d · …"
                        rf"{a_id[-6:]}", opt), opt
    assert b_id not in form  # prompt datasets are for GRPO
    grpo = client.get("/runs/new/grpo").text
    opt = re.search(rf'<option value="{b_id}"[^>]*>([^<]*)</option>', grpo).group(1)
    assert opt.startswith("train.jsonl — GRPO prompts, 30 rows, ") and opt.endswith(b_id[-6:])
    assert a_id not in grpo  # SFT files are not offered for GRPO by default
    assert a_id in client.get(f"/runs/new/grpo?dataset={a_id}").text


def test_an_admins_pickers_put_own_datasets_first_and_name_other_owners(app, client, engine):
    """A trial finding: the admin's run form defaulted to a member's newest upload (three
    entries read alike), trained on it unnoticed, and the member could then not delete their own
    dataset, told about a run id that answered 404 for them."""
    from tests.web.conftest import signed_in

    r = client.post("/api/users", json={"name": "bob", "password": "bob-password-1"})
    assert r.status_code in (200, 201), r.text
    mine = _upload(client)
    with signed_in(app, "bob", "bob-password-1") as bob:
        path = SHARED / "sft" / "alpaca_en_demo.json"
        with path.open("rb") as fh:
            r = bob.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": (path.name, fh)})
        theirs = r.json()["id"]
        run_validations(app)
        form = client.get("/runs/new").text
        picked = re.search(r'<select name="dataset">(.*?)</select>', form, re.S).group(1)
        options = re.findall(r'<option value="([^"]+)" ?(selected)?>([^<]*)</option>', picked)
        assert [o[0] for o in options][:2] == [mine, theirs] and options[0][1] == "selected"
        assert options[1][2].endswith("· bob&#39;s") and "bob" not in options[0][2]
        assert "bob" not in bob.get("/runs/new").text.split('name="dataset"')[1].split("</select>")[0]
        r = client.post("/runs", data=_form(client, theirs, name="on-bobs"), follow_redirects=False)
        run_id = r.headers["location"].rsplit("/", 1)[1]
        r = bob.delete(f"/api/datasets/{theirs}")
        assert r.status_code == 409 and "is used by another user's run" in r.text
        assert run_id not in r.text and "on-bobs" not in r.text
        r = client.delete(f"/api/datasets/{theirs}")  # the admin sees the run: it is named
        assert r.status_code == 409 and "is used by run on-bobs" in r.text
