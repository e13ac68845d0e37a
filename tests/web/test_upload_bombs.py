"""Uploads against the real web process (``python -m app.web.main``, a subprocess): the upload
returns at once with the dataset ``validating``, the web's memory stays under 512 MiB and
``/healthz`` keeps answering while a large file streams in; the files that took minutes and
gigabytes before (a 50 MB one-row JSONL, a 20 MiB CSV field, a Parquet file that decompresses
to gigabytes) end ``error`` naming the row or the limit, validated by the real job function."""
from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from app.settings import Settings
from app.store.db import make_engine
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1024 * 1024


@pytest.fixture
def web(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WHETSTONE_DATA_DIR": str(tmp_path), "WHETSTONE_PORT": str(port),
           "WHETSTONE_ADMIN_PASSWORD": ADMIN_PASSWORD, "WHETSTONE_ADMIN_USER": ADMIN_USER,
           "WHETSTONE_MAX_UPLOAD_MB": "128"}
    proc = subprocess.Popen([sys.executable, "-m", "app.web.main"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "web.log", "ab"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        raise AssertionError("web did not start")
    tok = httpx.post(base + "/api/login/access-token",
                     data={"username": ADMIN_USER, "password": ADMIN_PASSWORD}).json()["access_token"]
    yield {"base": base, "proc": psutil.Process(proc.pid), "dir": tmp_path,
           "headers": {"Authorization": f"Bearer {tok}"}}
    proc.terminate()
    proc.wait(30)


def _bombs() -> dict[str, bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    one_row = b'{"text": "' + b"a" * (50 * MiB) + b'"}\n'
    csv = b"text,label\n" + b'"' + b"b" * (20 * MiB) + b'",1\n'
    buf = io.BytesIO()  # 1 row group, 400k rows of a 4 KiB string: ~1.6 GB once decompressed
    pq.write_table(pa.table({"text": ["c" * 4096] * 400_000}), buf, compression="zstd",
                   use_dictionary=False)
    return {"one_row.jsonl": one_row, "field.csv": csv, "bomb.parquet": buf.getvalue()}


def test_uploads_keep_the_web_small_and_responsive(web):
    rss_peak, latencies, stop = [0], [], threading.Event()

    def watch():
        while not stop.is_set():
            t = time.monotonic()
            assert httpx.get(web["base"] + "/healthz", timeout=10).status_code == 200
            latencies.append(time.monotonic() - t)
            rss_peak[0] = max(rss_peak[0], web["proc"].memory_info().rss)
            time.sleep(0.05)

    bombs = _bombs()  # built first: the probe thread shares this process's GIL
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    ids = {}
    try:
        for name, data in bombs.items():
            t = time.monotonic()
            r = httpx.post(web["base"] + "/v1/files",
                           files={"file": (name, data)}, data={"purpose": "fine-tune"},
                           headers=web["headers"], timeout=120)
            took = time.monotonic() - t
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "uploaded"  # recorded at once; validated in a job
            ids[name] = (r.json()["id"], took, len(data))
    finally:
        stop.set()
        th.join(15)
    worst = max(latencies)
    print(f"web RSS peak {rss_peak[0] / MiB:.0f} MiB; /healthz worst {worst * 1000:.0f} ms over "
          f"{len(latencies)} probes; uploads: "
          + ", ".join(f"{n} {size / MiB:.1f} MiB in {took:.2f} s" for n, (_, took, size) in ids.items()))
    assert rss_peak[0] < 512 * MiB
    assert worst < 0.5  # target 0.1 s; 2 shared cores under other engineers' test load

    # the validation (the real job function, in this process) refuses each, bounded
    settings = Settings(data_dir=web["dir"])
    engine = make_engine(settings.resolved_database_url)

    class _App:  # what run_validations reads
        class state:
            pass

    _App.state.engine, _App.state.settings = engine, settings
    from tests.web.conftest import run_validations

    t = time.monotonic()
    assert run_validations(_App) == 3
    took = time.monotonic() - t
    files = {n: httpx.get(f"{web['base']}/v1/files/{i}", headers=web["headers"]).json()
             for n, (i, _, _) in ids.items()}
    print(f"3 validations in {took:.1f} s; " + "; ".join(f"{n}: {f['status_details']}"
                                                        for n, f in files.items()))
    assert all(f["status"] == "error" for f in files.values()), files
    assert "line 1 is 50.0 MiB, over the limit of 8.0 MiB per row" in files["one_row.jsonl"]["status_details"]
    assert "line 2 is 20.0 MiB, over the limit of 8.0 MiB" in files["field.csv"]["status_details"]
    assert "Parquet file decompresses to more than" in files["bomb.parquet"]["status_details"]
    assert took < 30
