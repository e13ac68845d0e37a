"""An open event stream ends once its caller is signed out, the key revoked or the user disabled
(QA trial: 8 more metric events arrived on a stream opened before sign-out)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from app.store import repo
from app.store.schema import Dataset
from app.store.specs import TrainSpec
from app.studio import accounts
from tests.conftest import SHARED_DATA
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER


@pytest.mark.parametrize("how", ["token ended", "user disabled"])
def test_a_stream_ends_when_its_caller_loses_access(server, app, engine, monkeypatch, how):
    from app.web import sse

    monkeypatch.setattr(sse, "AUTH_RECHECK_SECONDS", 0.5)
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    member = accounts.create_user(engine, "streamer", "streamer-password-1", actor=admin)
    ds = repo.add_dataset(engine, Dataset(filename="a.json", format="alpaca", rows=3,
                                          owner=member.id,
                                          path=str(SHARED_DATA / "sft" / "alpaca_en_demo.json")))
    run, _ = repo.create_run(engine, TrainSpec(model="stories260K", dataset=ds.id), owner=member.id)
    token = httpx.post(f"{server}/api/login/access-token",
                       data={"username": "streamer", "password": "streamer-password-1"}).json()
    headers = {"Authorization": f"Bearer {token['access_token']}"}
    seen: list[str] = []
    closed = threading.Event()

    def read() -> None:
        with httpx.stream("GET", f"{server}/runs/{run.id}/events", headers=headers,
                          timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                seen.append(line)
        closed.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + 10
    while not any(line.startswith("event: state") for line in seen) and time.time() < deadline:
        time.sleep(0.05)
    assert any(line.startswith("event: state") for line in seen), seen  # the stream is live
    assert not closed.wait(1.5)  # and stays open while the caller may read it
    t0 = time.monotonic()
    if how == "token ended":
        accounts.end_token(engine, token["access_token"])
    else:
        accounts.set_disabled(engine, admin, member.id, True)
    assert closed.wait(5), "the stream was still open 5 s after the caller lost access"
    assert time.monotonic() - t0 < 3
    r = httpx.get(f"{server}/runs/{run.id}/events", headers=headers, timeout=10)
    assert r.status_code == 401
