"""Run notifications (issue 16): a user's webhook URL (account page or /api, validated) gets a
signed JSON POST from the worker when a run's job succeeds, fails or is cancelled; a webhook
that fails is a warning in the run's log and changes nothing else. A real local HTTP server
receives the POSTs and checks each signature the Standard Webhooks way with its own stdlib
HMAC; the jobs run in the real worker loop (in process) with a stand-in for the training itself
(``fake_train``: what it does is chosen by the run's name), so the test takes seconds.

Trial findings: a relative or non-http(s) URL, an unsigned delivery, and a webhook to an
internal address (loopback, private, link-local / cloud metadata) called from the worker. The
receiver here is on loopback, so the tests that deliver turn the admin setting
``webhook_allow_private`` on; with it off such a URL is refused when set (every surface) and
again at delivery, where the host is resolved anew."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import shutil
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


def verify(secret: str, headers, body: bytes) -> bool:
    """A receiver's check of a Standard Webhooks signature (written from the spec, not from
    the studio's code): HMAC-SHA256 keyed with the base64 part of ``whsec_...`` over
    ``id.timestamp.body``, one of the space-separated ``v1,<base64>`` values, a recent
    timestamp."""
    key = base64.b64decode(secret.split("_", 1)[1])
    msg_id, ts = headers["webhook-id"], headers["webhook-timestamp"]
    expected = base64.b64encode(hmac.new(key, f"{msg_id}.{ts}.".encode() + body,
                                         hashlib.sha256).digest()).decode()
    given = [v.split(",", 1)[1] for v in headers["webhook-signature"].split() if
             v.startswith("v1,")]
    return abs(time.time() - int(ts)) < 300 and any(hmac.compare_digest(expected, g)
                                                    for g in given)


class _Hooks(BaseHTTPRequestHandler):
    received: list = []
    secret: str | None = None

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        ok = verify(type(self).secret, self.headers, body)
        type(self).received.append((self.path, self.headers["Content-Type"], json.loads(body)))
        self.send_response(500 if self.path == "/broken" else 302 if self.path == "/redirect"
                           else 200 if ok else 401)
        if self.path == "/redirect":
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
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


def _save(client, url: str) -> str:
    """Save ``url`` as the webhook on the account page; returns the secret shown once."""
    r = client.post("/account/webhook", data={"webhook_url": url}, follow_redirects=False)
    assert r.status_code == 303, r.text[-2000:]
    page = client.get("/account").text
    secret = page.split('<code id="webhook-secret">', 1)[1].split("<", 1)[0]
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    assert secret not in client.get("/account").text  # shown once
    return secret


def test_webhook_gets_each_run_end(app, client, engine, settings, hooks, monkeypatch):
    from worker import loop

    url, received = hooks
    settings.webhook_allow_private = True  # the receiver is on loopback
    monkeypatch.setitem(loop.HANDLERS, "train", "tests.web.test_run_notify:fake_train")
    for bad, why in (("ftp://example.com/x", "must be an absolute http:// or https:// URL"),
                     ("https://user:pw@example.com/", "must not hold a user name"),
                     ("http:///nohost", "with a host"), ("https://a b.example/", "spaces")):
        r = client.post("/account/webhook", data={"webhook_url": bad})
        assert r.status_code == 422 and why in r.text, (bad, r.text[-2000:])
    _Hooks.secret = _save(client, f" {url}/hook ")
    assert f'value="{url}/hook"' in client.get("/account").text

    ds = upload_sft(client)
    settings.heartbeat_seconds = 0.05
    w = loop.Worker(settings, worker_id="w-notify", kinds=["train"], poll_interval=0.05)
    w.engine = engine
    ok, job = _run(client, w, ds, "ok")
    assert job.state == JobState.SUCCEEDED
    path, ctype, body = received[-1]
    assert (path, ctype) == ("/hook", "application/json")  # and signed: the receiver said 200
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
    _Hooks.secret = _save(client, f"{url}/broken")
    _, job = _run(client, w, ds, "ok")
    assert job.state == JobState.SUCCEEDED and received[-1][0] == "/broken"
    assert f"webhook: POST {url}/broken failed: HTTP 500 Internal Server Error" in _logs(
        engine, job.id)
    _save(client, "http://127.0.0.1:9/closed")
    _, job = _run(client, w, ds, "ok")
    assert job.state == JobState.SUCCEEDED and len(received) == 4
    assert any(m.startswith("webhook: POST http://127.0.0.1:9/closed failed:")
               for m in _logs(engine, job.id))
    client.post("/account/webhook", data={"webhook_url": ""})  # cleared: nothing is sent
    _, job = _run(client, w, ds, "ok")
    assert len(received) == 4 and not any("webhook" in m for m in _logs(engine, job.id))


#: URLs refused when set (the admin setting off), with what the message says of each.
REFUSED = [("/hook", "must be an absolute http:// or https:// URL with a host"),
           ("hooks.example.com/x", "must be an absolute http:// or https:// URL"),
           ("javascript:alert(1)", "must be an absolute http:// or https:// URL"),
           ("file:///etc/passwd", "must be an absolute http:// or https:// URL"),
           ("http://127.0.0.1:8000/hook", "127.0.0.1 is loopback"),
           ("http://[::1]/hook", "::1 is loopback"),
           ("http://localhost:8000/", "localhost is this machine (loopback)"),
           ("http://api.localhost/", "api.localhost is this machine (loopback)"),
           ("http://2130706433/", "2130706433 resolves to 127.0.0.1 (loopback)"),
           ("http://10.0.0.7/hook", "10.0.0.7 is private"),
           ("https://172.16.5.4/hook", "172.16.5.4 is private"),
           ("http://192.168.1.20:9000/", "192.168.1.20 is private"),
           ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is link-local"),
           ("http://[fd12::1]/", "fd12::1 is private"),
           ("http://[::ffff:127.0.0.1]/", "::ffff:127.0.0.1 is loopback"),
           # a trial's: an IPv6 zone, a percent-encoded 127.0.0.1, 6to4 of 127.0.0.1
           ("http://[fe80::1%25eth0]/", "must not hold % in its host"),
           ("http://%31%32%37.0.0.1:8099/", "must not hold % in its host"),
           ("http://[2002:7f00:1::]/", "2002:7f00:1:: is loopback"),
           ("http://0.0.0.0:8000/", "0.0.0.0 is unspecified")]


def test_webhook_url_must_be_a_public_http_url(client, settings):
    assert settings.webhook_allow_private is False  # the default
    for bad, why in REFUSED:
        r = client.put("/api/me/webhook", json={"webhook_url": bad})
        assert r.status_code == 422, (bad, r.text)
        err = r.json()["error"]
        assert err["param"] == "webhook_url" and why in err["message"], (bad, err)
        r = client.post("/account/webhook", data={"webhook_url": bad})
        assert r.status_code == 422 and why in r.text, (bad, r.text[-2000:])
        assert 'class="field-error" role="alert">' in r.text and "Traceback" not in r.text
    assert "an admin may allow internal ones with WHETSTONE_WEBHOOK_ALLOW_PRIVATE" in err["message"]
    assert client.get("/api/me/webhook").json() == {"webhook_url": None, "signed": False,
                                                    "secret": None}
    # a public host (an IP literal, or a name that does not resolve here yet) is accepted, with
    # a new secret shown in that answer only
    for good in ("https://93.184.216.34/hooks/whetstone?token=abc", "https://hooks.example.com/w"):
        r = client.put("/api/me/webhook", json={"webhook_url": f" {good} "})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["webhook_url"] == good and out["signed"] is True
        assert out["secret"].startswith("whsec_") and len(base64.b64decode(out["secret"][6:])) == 32
    first = out["secret"]
    assert client.get("/api/me/webhook").json() == {"webhook_url": good, "signed": True,
                                                    "secret": None}
    assert first not in client.get("/api/me").text and first not in client.get("/account").text
    again = client.put("/api/me/webhook", json={"webhook_url": good}).json()["secret"]
    assert again != first  # saving makes a new one
    for body in ({"url": "https://hooks.example.com/x"}, {}):  # misspelt: 422, nothing cleared
        r = client.put("/api/me/webhook", json=body)
        assert r.status_code == 422, (body, r.text)
    assert client.get("/api/me/webhook").json()["webhook_url"] == good
    r = client.put("/api/me/webhook", json={"webhook_url": None})
    assert r.status_code == 200 and r.json() == {"webhook_url": None, "signed": False,
                                                 "secret": None}
    r = client.post("/account/webhook", data={"webhook_url": ""})  # the form's "clear"
    assert r.status_code == 200 and "Webhook removed: no run end is sent." in r.text
    # the admin setting lets a team's internal receiver in
    settings.webhook_allow_private = True
    r = client.put("/api/me/webhook", json={"webhook_url": "http://10.0.0.7/hook"})
    assert r.status_code == 200 and r.json()["signed"] is True
    r = client.put("/api/me/webhook", json={"webhook_url": "/hook"})  # still a URL, though
    assert r.status_code == 422 and r.json()["error"]["param"] == "webhook_url"


def test_delivery_resolves_the_host_again_and_refuses_internal_ones(app, client, engine, settings,
                                                                     hooks, monkeypatch):
    from app.store.db import session_scope
    from app.store.schema import User
    from worker import loop

    url, received = hooks
    port = url.rsplit(":", 1)[1]
    monkeypatch.setitem(loop.HANDLERS, "train", "tests.web.test_run_notify:fake_train")
    settings.webhook_allow_private = True
    # saved while internal receivers were allowed (or: its name resolved elsewhere then)
    r = client.put("/api/me/webhook", json={"webhook_url": f"http://2130706433:{port}/hook"})
    assert r.status_code == 200, r.text
    _Hooks.secret = r.json()["secret"]
    ds = upload_sft(client)
    settings.heartbeat_seconds = 0.05
    w = loop.Worker(settings, worker_id="w-notify", kinds=["train"], poll_interval=0.05)
    w.engine = engine
    _, job = _run(client, w, ds, "ok")
    assert len(received) == 1 and received[0][0] == "/hook"  # allowed, signed (answered 200)
    assert f"webhook: POST http://2130706433:{port}/hook answered 200" in _logs(engine, job.id)
    settings.webhook_allow_private = False  # the admin turns it off: the worker refuses
    _, job = _run(client, w, ds, "ok")
    assert job.state == JobState.SUCCEEDED and len(received) == 1
    assert (f"webhook: POST http://2130706433:{port}/hook refused: 2130706433 resolves to "
            "127.0.0.1 (loopback), an internal address (an admin may allow them with "
            "WHETSTONE_WEBHOOK_ALLOW_PRIVATE)") in _logs(engine, job.id)
    # a webhook set before deliveries were signed has no secret: nothing is sent to it
    settings.webhook_allow_private = True
    admin = client.get("/api/me").json()["id"]
    with session_scope(engine) as s:
        user = s.get(User, admin)
        user.webhook_url, user.webhook_secret = f"{url}/hook", None
        s.add(user)
    assert 'id="webhook-unsigned"' in client.get("/account").text
    _, job = _run(client, w, ds, "ok")
    assert len(received) == 1
    assert any(m.startswith(f"webhook: POST {url}/hook refused: the webhook has no signing "
                            "secret") for m in _logs(engine, job.id))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_delivery_checks_the_certificate_for_the_name(tmp_path, monkeypatch):
    """An https webhook goes to the address that was checked, with the certificate verified
    for the URL's host name (SNI and Host header too); redirects are not followed."""
    import ssl
    import subprocess

    from app.studio import notify as rules
    from worker import notify

    if rules.resolve("localhost", 443)[:1] != ["127.0.0.1"]:
        pytest.skip("localhost does not resolve to 127.0.0.1 first here")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    _Hooks.received, secret = [], rules.new_secret()
    _Hooks.secret = secret
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hooks)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        hook = notify.Delivery(f"https://localhost:{srv.server_port}/hook?t=1", secret,
                               {"event": "run.finished"})
        with pytest.raises(notify.Refused, match="localhost is this machine"):
            notify.send(hook, "msg_1", allow_private=False)
        with pytest.raises(ssl.SSLCertVerificationError, match="self-signed"):
            notify.send(hook, "msg_1", allow_private=True)  # not a trusted certificate
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        assert notify.send(hook, "msg_1", allow_private=True) == (200, "OK")  # signed right
        assert _Hooks.received == [("/hook?t=1", "application/json",
                                    {"event": "run.finished"})]
        moved = notify.Delivery(f"https://localhost:{srv.server_port}/redirect", secret, {})
        assert notify.send(moved, "msg_3", allow_private=True) == (302, "Found")
        assert [r[0] for r in _Hooks.received] == ["/hook?t=1", "/redirect"]  # not followed
        other = notify.Delivery(f"https://127.0.0.1:{srv.server_port}/hook", secret, {})
        with pytest.raises(ssl.SSLCertVerificationError, match="127.0.0.1"):
            notify.send(other, "msg_2", allow_private=True)  # the name is what is verified
    finally:
        srv.shutdown()
