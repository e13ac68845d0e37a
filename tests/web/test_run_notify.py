"""Run notifications (issue 16): a user's webhook URL (account page, validated) gets a JSON POST
from the worker when a run's job succeeds, fails or is cancelled; a webhook that fails is a
warning in the run's log and changes nothing else. A real local HTTP server receives the POSTs;
the jobs run in the real worker loop (in process) with a stand-in for the training itself
(``fake_train``: what it does is chosen by the run's name), so the test takes seconds."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.store import events, queue, repo
from app.store.schema import JobState
from tests.web.conftest import upload_sft


def fake_train(ctx) -> dict:
    """The ``train`` handler of this test: by run name ``ok`` succeeds with a result, ``boom``
    fails, ``cancel`` is cancelled by its user while it runs."""
    run = repo.get_run(ctx.engine, ctx.payload["run_id"])
    ctx.metric(step=1, total_steps=2, loss=2.5)
    if run.name == "boom":
        raise RuntimeError("the GPU caught fire")
    if run.name == "cancel":
        queue.cancel(ctx.engine, ctx.job.id)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            ctx.check()  # raises JobCancelled once the lease thread saw the flag
            time.sleep(0.02)
    return {"steps": 2, "first_loss": 2.5, "final_loss": 1.25, "train_loss": 1.8}


class _Hooks(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, self.headers["Content-Type"], json.loads(body)))
        self.send_response(500 if self.path == "/broken" else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hooks():
    _Hooks.received = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hooks)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_port}", _Hooks.received
    srv.shutdown()


def _run(client, w, ds: str, name: str) -> tuple[str, object]:
    r = client.post("/api/runs", json={"model": "stories260K", "dataset": ds, "max_steps": 2,
                                       "name": name})
    assert r.status_code == 201, r.text
    w.serve(once=True)
    from worker import notify

    notify.wait()
    run = repo.get_run(client.app.state.engine, r.json()["id"])
    return run.id, queue.get_job(client.app.state.engine, run.job_id)


def _logs(engine, job_id: int) -> list[str]:
    return [e.data["message"] for e in events.since(engine, job_id, types=["log"])]


def test_webhook_gets_each_run_end(app, client, engine, settings, hooks, monkeypatch):
    from worker import loop

    url, received = hooks
    monkeypatch.setitem(loop.HANDLERS, "train", "tests.web.test_run_notify:fake_train")
    for bad, why in (("ftp://example.com/x", "must be an http:// or https:// URL"),
                     ("https://user:pw@example.com/", "must not hold a user name"),
                     ("http:///nohost", "with a host"), ("https://a b.example/", "spaces")):
        r = client.post("/account/webhook", data={"webhook_url": bad})
        assert r.status_code == 422 and why in r.text, (bad, r.text[-2000:])
    r = client.post("/account/webhook", data={"webhook_url": f" {url}/hook "},
                    follow_redirects=False)
    assert r.status_code == 303
    assert f'value="{url}/hook"' in client.get("/account").text

    ds = upload_sft(client)
    settings.heartbeat_seconds = 0.05
    w = loop.Worker(settings, worker_id="w-notify", kinds=["train"], poll_interval=0.05)
    w.engine = engine
    ok, job = _run(client, w, ds, "ok")
    assert job.state == JobState.SUCCEEDED
    path, ctype, body = received[-1]
    assert (path, ctype) == ("/hook", "application/json")
    assert body == {"event": "run.finished", "run_id": ok, "name": "ok", "kind": "sft",
                    "state": "succeeded", "job_id": job.id, "error": None,
                    "finished_at": job.finished_at, "url": f"/runs/{ok}",
                    "metrics": {"steps": 2, "first_loss": 2.5, "final_loss": 1.25,
                                "train_loss": 1.8}}
    assert f"webhook: POST {url}/hook answered 200" in _logs(engine, job.id)

    boom, job = _run(client, w, ds, "boom")
    assert job.state == JobState.FAILED and len(received) == 2
    body = received[-1][2]
    assert (body["run_id"], body["state"]) == (boom, "failed")
    assert "the GPU caught fire" in body["error"] and body["metrics"] == {"step": 1, "loss": 2.5}

    cancelled, job = _run(client, w, ds, "cancel")
    assert job.state == JobState.CANCELLED and len(received) == 3
    assert (received[-1][2]["run_id"], received[-1][2]["state"]) == (cancelled, "cancelled")

    # a webhook that fails: a warning in the run's log, the run's end unchanged
    assert client.post("/account/webhook", data={"webhook_url": f"{url}/broken"}).status_code == 200
    _, job = _run(client, w, ds, "ok")
    assert job.state == JobState.SUCCEEDED and received[-1][0] == "/broken"
    assert f"webhook: POST {url}/broken failed: HTTP 500 Internal Server Error" in _logs(
        engine, job.id)
    client.post("/account/webhook", data={"webhook_url": "http://127.0.0.1:9/closed"})
    _, job = _run(client, w, ds, "ok")
    assert job.state == JobState.SUCCEEDED and len(received) == 4
    assert any(m.startswith("webhook: POST http://127.0.0.1:9/closed failed:")
               for m in _logs(engine, job.id))
    client.post("/account/webhook", data={"webhook_url": ""})  # cleared: nothing is sent
    _, job = _run(client, w, ds, "ok")
    assert len(received) == 4 and not any("webhook" in m for m in _logs(engine, job.id))
