"""Uploads against the real web process (``python -m app.web.main``, a subprocess): the upload
returns at once with the dataset ``validating``, the web's memory stays under 512 MiB and
``/healthz`` keeps answering while large files stream in (probed from another process every
10 ms: its p99 over the 200-300 probes during the uploads stays within 100 ms of its p99 on the same
machine just before them, and no probe waits a second);
the files that took minutes and gigabytes before (a 50 MB one-row JSONL, a 20 MiB CSV field, a
Parquet file that decompresses to gigabytes) end ``error`` naming the row or the limit,
validated by the real job function."""
from __future__ import annotations

import io
import json
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


def _ahead_of_other_tenants() -> None:
    """Run ahead of the box's other processes where allowed (root, as in CI's container), so the
    latencies measure the web process itself, not the scheduler's share for other test runs."""
    try:
        os.nice(-10)
    except OSError:
        pass


@pytest.fixture
def web(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WHETSTONE_DATA_DIR": str(tmp_path), "WHETSTONE_PORT": str(port),
           "WHETSTONE_ADMIN_PASSWORD": ADMIN_PASSWORD, "WHETSTONE_ADMIN_USER": ADMIN_USER,
           "WHETSTONE_MAX_UPLOAD_MB": "128"}
    proc = subprocess.Popen([sys.executable, "-m", "app.web.main"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "web.log", "ab"),
                            preexec_fn=_ahead_of_other_tenants)
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


#: A /healthz prober in its own process (not this one's GIL): a keep-alive GET every 10 ms, each
#: answer's ``[monotonic start, seconds]`` printed as JSON once stdin closes.
PROBE = r"""
import http.client, json, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
stop, out = threading.Event(), []
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
conn = http.client.HTTPConnection(host, port, timeout=30)
while not stop.is_set():
    t = time.monotonic()
    conn.request("GET", "/healthz")
    r = conn.getresponse()
    r.read()
    assert r.status == 200, r.status
    out.append([t, time.monotonic() - t])
    time.sleep(0.01)
print(json.dumps(out))
"""


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def _bombs() -> dict[str, bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    one_row = b'{"text": "' + b"a" * (50 * MiB) + b'"}\n'
    csv = b"text,label\n" + b'"' + b"b" * (20 * MiB) + b'",1\n'
    buf = io.BytesIO()  # 1 row group, 400k rows of a 4 KiB string: ~1.6 GB once decompressed
    pq.write_table(pa.table({"text": ["c" * 4096] * 400_000}), buf, compression="zstd",
                   use_dictionary=False)
    # a 120 MiB file just within the limit (128 MiB here): the longest stream of the set, sent
    # three times so the uploads last long enough (200-300 probes) for a p99 that is not the max
    row = json.dumps({"text": "d" * 1000}).encode() + b"\n"
    many = row * (120 * MiB // len(row))
    return {"one_row.jsonl": one_row, "field.csv": csv, "bomb.parquet": buf.getvalue(),
            **{f"many_rows_{i}.jsonl": many for i in (1, 2, 3)}}


def test_uploads_keep_the_web_small_and_responsive(web):
    rss_peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            rss_peak[0] = max(rss_peak[0], web["proc"].memory_info().rss)
            time.sleep(0.05)

    bombs = _bombs()
    host, port = web["base"].removeprefix("http://").split(":")
    probe = subprocess.Popen([sys.executable, "-c", PROBE, host, port], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, preexec_fn=_ahead_of_other_tenants)
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    ids, windows = {}, []
    try:
        time.sleep(3)  # the idle baseline: the same machine, its load, no upload
        idle_end = time.monotonic()
        for name, data in bombs.items():
            t = time.monotonic()
            r = httpx.post(web["base"] + "/v1/files",
                           files={"file": (name, data)}, data={"purpose": "fine-tune"},
                           headers=web["headers"], timeout=120)
            took = time.monotonic() - t
            windows.append((t, t + took))
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "uploaded"  # recorded at once; validated in a job
            ids[name] = (r.json()["id"], took, len(data))
    finally:
        stop.set()
        th.join(15)
        probes = json.loads(probe.communicate(timeout=60)[0])
    idle = [d for t, d in probes if t < idle_end]
    busy = [d for t, d in probes if any(a <= t <= b for a, b in windows)]
    load = os.getloadavg()[0]
    print(f"web RSS peak {rss_peak[0] / MiB:.0f} MiB; /healthz p99 {_p99(busy) * 1000:.0f} ms "
          f"(max {max(busy) * 1000:.0f}) over {len(busy)} probes during the uploads, "
          f"{_p99(idle) * 1000:.0f} ms over {len(idle)} idle ones; load average {load:.1f} on "
          f"{os.cpu_count()} cores; uploads: "
          + ", ".join(f"{n} {size / MiB:.1f} MiB in {took:.2f} s" for n, (_, took, size) in ids.items()))
    assert rss_peak[0] < 512 * MiB
    # pyarrow stays out of the web (its cold first import held it for 1.5 s in CI): the row count
    # of a Parquet upload is the validation job's
    assert not [m.path for m in web["proc"].memory_maps() if "arrow" in os.path.basename(m.path)]
    assert len(busy) >= 150 and len(idle) >= 20
    # target: no upload blocks other requests for more than 100 ms; what the machine's own load
    # adds (the idle p99, measured just before) is allowed on top; no probe waits a second
    allowance = 0.1 + _p99(idle)
    slow = [f"{d * 1000:.0f} ms at +{t - a:.2f} s into {name}" for t, d in probes
            for name, (a, b) in zip(ids, windows) if a <= t <= b and d >= allowance]
    assert _p99(busy) < allowance and max(busy) < 1.0, slow

    # the validation (the real job function, in this process) refuses each, bounded
    settings = Settings(data_dir=web["dir"])
    engine = make_engine(settings.resolved_database_url)

    class _App:  # what run_validations reads
        class state:
            pass

    _App.state.engine, _App.state.settings = engine, settings
    from tests.web.conftest import run_validations

    t = time.monotonic()
    for name in [n for n in ids if n.startswith("many_rows")]:  # for the latency only
        many = ids.pop(name)[0]
        assert httpx.delete(f"{web['base']}/v1/files/{many}",
                            headers=web["headers"]).status_code == 200
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


def test_an_abandoned_upload_leaves_no_partial_file(web):
    """A client that goes away mid-upload: the parsing thread stops and the partial file
    (which existed while the bytes streamed in) is deleted; the web keeps serving."""
    host, port = web["base"].removeprefix("http://").split(":")
    boundary = "AbandonedXyZ"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            "filename=\"gone.jsonl\"\r\n\r\n").encode()
    uploads = web["dir"] / "uploads"
    with socket.create_connection((host, int(port))) as s:
        s.sendall((f"POST /v1/files HTTP/1.1\r\nHost: {host}:{port}\r\n"
                   f"Authorization: {web['headers']['Authorization']}\r\n"
                   f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                   f"Content-Length: {100 * MiB}\r\n\r\n").encode() + head)
        for _ in range(20):
            s.sendall(b'{"text": "abandoned"}\n' * (MiB // 22))
        deadline = time.monotonic() + 30
        while not list(uploads.glob("*.part")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.name.endswith(".part") for p in uploads.iterdir()] == [True]
    deadline = time.monotonic() + 30
    while list(uploads.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(uploads.iterdir()) == []
    assert httpx.get(web["base"] + "/healthz", timeout=10).status_code == 200
    files = httpx.get(web["base"] + "/v1/files", headers=web["headers"]).json()["data"]
    assert files == []
