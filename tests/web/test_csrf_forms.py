"""CSRF tokens outside a session's urlencoded forms, over HTTP against the real app: the upload
forms (multipart) carry the session's token as their first field, never in the URL (so never in
an access log), and it is read before the file streams to disk."""
from __future__ import annotations

import json
import logging
import re

import httpx
from fastapi.testclient import TestClient

from app.settings import Settings
from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, login_form_token
from tests.web.test_account_security import _serve

FIRST_INPUT = re.compile(r'<form[^>]*action="(?P<action>[^"]+)"[^>]*enctype="multipart/form-data"'
                         r'[^>]*>\s*(?:\{#.*?#\})?\s*<input type="hidden" name="(?P<name>[^"]+)" '
                         r'value="(?P<value>[^"]*)"', re.S)


def _browser(app) -> TestClient:
    """A cookie-session client signed in through the sign-in form, like a browser."""
    c = TestClient(app, base_url="http://127.0.0.1")
    r = c.post("/login", data={"username": ADMIN_USER, "password": ADMIN_PASSWORD,
                               "csrf_token": login_form_token(c)}, follow_redirects=False)
    assert r.status_code == 303, r.text
    return c


def _rows(n: int) -> bytes:
    return b"\n".join(json.dumps({"instruction": f"Say number {i}.", "input": "",
                                  "output": f"Number {i}. " + "x" * 40}).encode()
                      for i in range(n))


def test_upload_forms_send_the_token_as_first_field_not_in_the_url(client, app):
    c = _browser(app)
    session_token = re.search(r'<meta name="csrf-token" content="([^"]+)"',
                              c.get("/datasets").text).group(1)
    for page, action in (("/datasets", "/datasets"), ("/runs/new/grpo", "/grpo/datasets")):
        html = c.get(page).text
        form = FIRST_INPUT.search(html)
        assert form is not None, page
        assert (form["action"], form["name"], form["value"]) == (action, "csrf_token",
                                                                 session_token)
        assert "csrf_token=" not in html  # in no URL of the page

    body = _rows(4000)  # ~330 KiB: the token is read from the head, the rest streams after it
    assert len(body) > 300_000
    r = c.post("/datasets", data={"csrf_token": session_token},
               files={"file": ("big.jsonl", body)}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/datasets/file-")
    ds = client.get(f"/api/datasets/{r.headers['location'].rsplit('/', 1)[1]}").json()
    assert ds["filename"] == "big.jsonl" and ds["bytes"] == len(body)

    r = c.post("/datasets", files={"file": ("no-token.jsonl", body)}, follow_redirects=False)
    assert r.status_code == 403 and "missing token" in r.text
    r = c.post("/datasets", files={"file": ("late.jsonl", body), "csrf_token": (None, session_token)},
               follow_redirects=False)
    assert r.status_code == 403  # only the first field is read: the file is not buffered
    r = c.post(f"/datasets?csrf_token={session_token}", files={"file": ("url.jsonl", body)},
               follow_redirects=False)
    assert r.status_code == 403  # a token in the URL is not read (it would be logged)
    r = c.post("/datasets", data={"csrf_token": "forged"}, files={"file": ("f.jsonl", body)},
               follow_redirects=False)
    assert r.status_code == 403 and "does not match" in r.text
    prompts = (SHARED / "grpo" / "gsm8k" / "test.jsonl").read_bytes()  # the GRPO form's upload
    r = c.post("/grpo/datasets", data={"csrf_token": session_token},
               files={"file": ("gsm8k.jsonl", prompts)}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/datasets/file-")
    names = [d["filename"] for d in client.get("/api/datasets").json()["data"]]
    assert "gsm8k.jsonl" in names
    assert names.count("big.jsonl") == 1 and not {"no-token.jsonl", "late.jsonl", "url.jsonl",
                                                   "f.jsonl"} & set(names)


def test_the_access_log_never_shows_a_csrf_token_from_a_url(tmp_path):
    """A stale page or a script that still puts the token in a URL: uvicorn's access line (as
    ``whetstone-web`` configures it) says ``csrf_token=[redacted]``."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep()
    srv, th, base = _serve(Settings(data_dir=tmp_path / "data", admin_password=ADMIN_PASSWORD),
                           log_level="info")
    logging.getLogger("uvicorn.access").addHandler(keep)
    try:
        secret = "Zq9" * 14
        r = httpx.post(f"{base}/datasets?a=1&csrf_token={secret}&b=2", files={"file": ("x", b"")})
        assert r.status_code == 303 and r.headers["location"].startswith("/login")
        assert httpx.get(f"{base}/login?csrf_token={secret}").status_code == 200
    finally:
        srv.should_exit = True
        th.join(timeout=10)
        logging.getLogger("uvicorn.access").removeHandler(keep)
    access = [line for line in lines if "csrf_token=" in line]
    assert len(access) == 2 and all(secret not in line for line in lines), lines
    assert '"POST /datasets?a=1&csrf_token=[redacted]&b=2 HTTP/1.1" 303' in access[0]
