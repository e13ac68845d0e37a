"""Pages, htmx fragments, health, error pages and the import boundary of the web process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, signed_in
from tests.web.conftest import run_validations

ROOT = Path(__file__).resolve().parents[2]


def test_healthz(client):
    r = client.get("/healthz")  # an admin (Bearer)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "degraded" and "no live worker" in body["reason"]
    assert body["database"]["ok"] is True
    assert body["database"]["kind"] == "sqlite"
    assert body["database"]["migration"]
    assert body["workers"] == [] and body["live_workers"] == 0
    assert (body["gpu_slots"], body["cpu_slots"], body["cpu_lanes"]) == (0, 0, 0)


def test_healthz_shows_worker_hosts_and_pids_only_to_admins(client, app):
    from fastapi.testclient import TestClient

    from app.store import workers as workers_store
    from app.studio import accounts

    engine = app.state.engine
    workers_store.register(engine, "gpu-box-7:slot0", "gpu-box-7", 4242, "cuda:0")
    admin = client.get("/healthz").json()
    assert admin["status"] == "ok" and admin["live_workers"] == 1 and "reason" not in admin
    assert [(w["host"], w["pid"], w["device"]) for w in admin["workers"]] == \
        [("gpu-box-7", 4242, "cuda:0")]
    accounts.create_user(engine, "mia", "mia-password",
                         actor=accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD))
    anonymous = TestClient(app, base_url="http://127.0.0.1").get("/healthz")
    with signed_in(app, "mia", "mia-password") as member:
        members = member.get("/healthz")
    for r in (anonymous, members):
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "database": {"ok": True, "kind": "sqlite"},
                            "live_workers": 1, "gpu_slots": 0, "cpu_slots": 0, "cpu_lanes": 0}
        assert "gpu-box-7" not in r.text and "4242" not in r.text


def test_demo_model_is_seeded(client):
    names = [m["name"] for m in client.get("/api/models").json()["data"]]
    assert "stories260K" in names


def test_every_page_renders(client):
    for path in ("/", "/datasets", "/models", "/runs/new"):
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.text.startswith("<!doctype html>")
        assert "/static/app.css" in r.text


def test_htmx_requests_get_only_the_fragment(client):
    hx = {"HX-Request": "true"}
    r = client.get("/", headers=hx)
    assert r.status_code == 200 and 'id="runs"' in r.text and "<html" not in r.text
    r = client.get("/datasets", headers={**hx, "HX-Target": "dataset_list"})
    assert 'id="dataset_list"' in r.text and "<html" not in r.text and "upload_form" not in r.text
    r = client.get("/models", headers=hx)
    assert 'id="model_list"' in r.text and "<html" not in r.text
    r = client.get("/runs/new", headers=hx)
    assert r.text.lstrip().startswith('<form id="run_form"') and "<html" not in r.text
    models = client.get("/api/models").json()["data"]
    r = client.get(f"/runs/new/template?model={models[0]['id']}", headers=hx)
    assert r.text.lstrip().startswith('<div id="chat_template"')
    assert "&lt;|im_start|&gt;" in r.text  # the default template is shown in full (escaped)


def test_not_found_is_a_friendly_page_and_json(client):
    r = client.get("/runs/ftjob-doesnotexist")
    assert r.status_code == 404 and "Not found" in r.text and "Traceback" not in r.text
    r = client.get("/api/runs/ftjob-doesnotexist")
    assert r.status_code == 404 and "ftjob-doesnotexist" in r.json()["error"]["message"]
    r = client.get("/v1/fine_tuning/jobs/ftjob-nope")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unexpected_errors_are_logged_not_shown(app, monkeypatch, caplog):
    from app.store import repo

    def boom(*a, **k):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(repo, "list_datasets", boom)
    with signed_in(app, raise_server_exceptions=False) as c:
        r = c.get("/datasets")
        assert r.status_code == 500
        assert "secret internal detail" not in r.text and "Traceback" not in r.text
        assert "Something went wrong" in r.text
        r = c.get("/api/datasets")
        assert r.status_code == 500 and r.json()["error"]["code"] == "server_error"
    assert any("secret internal detail" in (rec.exc_text or "") or rec.exc_info for rec in caplog.records)


def test_register_model_validation(client, settings):
    r = client.post("/models", data={"source": "local", "folder": "/nonexistent/dir"})
    assert r.status_code == 422 and "no folder at /nonexistent/dir" in r.text
    r = client.post("/models", data={"source": "llama2c", "checkpoint": "", "tokenizer": ""})
    assert r.status_code == 422 and "llama2.c checkpoint" in r.text
    ckpt = settings.seed_dir / "models" / "stories260K"
    r = client.post("/api/models", json={"source": "llama2c", "name": "tiny-copy",
                                         "checkpoint": str(ckpt / "stories260K.bin"),
                                         "tokenizer": str(ckpt / "tok512.bin")})
    assert r.status_code == 201 and r.json()["status"] == "pending"
    r = client.post("/api/models", json={"source": "hf", "hf_id": "Qwen/Qwen2.5-0.5B", "name": "tiny-copy"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "name"
    r = client.post("/models", data={"source": "hf", "hf_id": "HuggingFaceTB/SmolLM2-135M"},
                    follow_redirects=False)
    assert r.status_code == 303
    assert "SmolLM2-135M" in client.get("/models").text


def test_web_process_never_imports_the_ml_stack():
    code = ("import sys, json; import app.web.main as m; "
            "app = m.create_app(); "
            "print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in "
            "('torch', 'triton', 'transformers', 'whetstone_kernels', 'worker', 'peft', 'trl'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "WHETSTONE_DATA_DIR": "/tmp/ws-boundary"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_posting_form_disables_its_submit_button_in_flight():
    """Double submit must not create two runs/datasets: htmx disables the button meanwhile."""
    import re

    from app.web.render import TEMPLATES_DIR

    mine = sorted(p for p in TEMPLATES_DIR.glob("*.html") if p.name != "run_grpo_new.html")
    forms = [(p.name, m.group(0)) for p in mine
             for m in re.finditer(r"<form\b[^>]*>", p.read_text()) if "hx-post" in m.group(0)]
    assert len(forms) >= 5
    for name, tag in forms:
        assert "hx-disabled-elt=" in tag, (name, tag)


def test_delete_models_refused_while_runs_use_them(client, engine):
    from app.store import repo
    from app.store.schema import Model

    bad = repo.add_model(engine, Model(name="broken", source="hf", source_ref="x/broken",
                                       status="failed", error="404 Client Error: repo not found"),
                         import_job=False)
    form = client.get("/runs/new").text
    assert "broken" not in form  # a failed model is not offered for training
    page = client.get("/models").text
    assert f'hx-post="/models/{bad.id}/delete"' in page and "hx-confirm=" in page
    r = client.post(f"/models/{bad.id}/delete", headers={"HX-Request": "true"})
    assert r.status_code == 200 and "Deleted broken." in r.text
    assert all(m["name"] != "broken" for m in client.get("/api/models").json()["data"])

    from tests.conftest import SHARED_DATA as SHARED

    path = SHARED / "sft" / "alpaca_en_demo.json"
    with path.open("rb") as fh:
        ds = client.post("/datasets", files={"file": (path.name, fh)},
                         follow_redirects=False).headers["location"].rsplit("/", 1)[1]
    run_validations(client.app)
    used = repo.add_model(engine, Model(name="used", source="hf", source_ref="x/used",
                                        status="ready"), import_job=False)
    assert client.post("/api/runs", json={"model": "used", "dataset": ds}).status_code == 201
    r = client.delete(f"/api/models/{used.id}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_in_use"
    assert "used by run ftjob-" in r.json()["error"]["message"]
    r = client.post(f"/models/{used.id}/delete", headers={"HX-Request": "true"})
    assert r.status_code == 409 and "used by run" in r.text and 'id="model_list"' in r.text
    assert client.delete("/api/models/model-nope").status_code == 404
    spare = repo.add_model(engine, Model(name="spare", source="hf", source_ref="x/spare",
                                         status="ready"), import_job=False)
    r = client.delete("/api/models/spare")
    assert r.status_code == 200 and r.json()["deleted"] is True


def test_long_model_paths_and_errors_stay_inside_their_card(client, engine):
    from app.store import repo
    from app.store.schema import Model

    ref = "/a/very/long/path/" + "deeper/" * 30 + "model"
    repo.add_model(engine, Model(name="long", source="local", source_ref=ref, status="failed",
                                 error="OSError: " + "cannot load " * 40), import_job=False)
    page = client.get("/models").text
    assert '<div class="table-scroll"><table>' in page
    assert f'class="small ellipsis" title="{ref}"' in page
    assert 'class="error small model-error">OSError: cannot load' in page  # whole, not clipped
    css = client.get("/static/app.css").text
    assert ".table-scroll { overflow-x: auto;" in css and "text-overflow: ellipsis" in css


def test_small_things_health_favicon_cancel_confirm_artifacts_workers_and_length(client, engine):
    from app.store import queue, repo
    from app.store import workers as workers_store

    from tests.conftest import SHARED_DATA as SHARED

    page = client.get("/").text
    assert '<link rel="icon" href="data:image/svg+xml,' in page
    # the form's default length is capped at the model's context length
    model = repo.get_model(engine, "stories260K")
    repo.update_model(engine, model.id, status="ready", info={"max_position_embeddings": 512})
    assert 'name="max_seq_length" value="512"' in client.get("/runs/new").text
    path = SHARED / "sft" / "alpaca_en_demo.json"
    with path.open("rb") as fh:
        ds = client.post("/datasets", files={"file": (path.name, fh)},
                         follow_redirects=False).headers["location"].rsplit("/", 1)[1]
    run_validations(client.app)
    runs = [client.post("/api/runs", json={"model": "stories260K", "dataset": ds}).json()["id"]
            for _ in range(2)]
    run_page = client.get(f"/runs/{runs[0]}").text
    assert 'hx-confirm="Cancel this queued run?' in run_page  # says what a cancel keeps
    assert "appear here when the run finishes" in run_page
    # a worker busy with the first run: healthz is ok and the dashboard links the run
    workers_store.register(engine, "w1", "host", 1, "cpu")
    job = queue.claim(engine, "w1", 60, kinds=["train"])
    workers_store.touch(engine, "w1", job.id)
    assert client.get("/healthz").json()["status"] == "ok"
    assert f'<a href="/runs/{job.run_id}">' in client.get("/").text
    queue.fail(engine, job.id, "w1", "boom")
    failed = client.get(f"/runs/{job.run_id}").text
    assert "The run failed" in failed and "appear here when the run finishes" not in failed
    other = next(r for r in runs if r != job.run_id)
    client.post(f"/runs/{other}/cancel")
    cancelled = client.get(f"/runs/{other}").text
    assert "was cancelled" in cancelled and "appear here when the run finishes" not in cancelled
