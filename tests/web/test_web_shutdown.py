"""The real web process (``python -m app.web.main``) stops within seconds of SIGTERM (what
``docker stop``, systemd and docker/start.sh send) even while a client holds a live-update
stream open: uvicorn's graceful shutdown waits at most ``timeout_graceful_shutdown`` seconds for
open connections (trial s24: a run page left open kept the web in "Waiting for connections to
close" for minutes, serving nothing)."""
from __future__ import annotations

import signal
import socket
import time

import httpx

from tests.web.test_upload_bombs import web  # noqa: F401 - the real web process fixture


def test_sigterm_stops_the_web_within_seconds_with_a_stream_open(web) -> None:  # noqa: F811
    base, headers = web["base"], web["headers"]
    body = b'{"instruction": "hi", "output": "hello"}\n'
    r = httpx.post(base + "/v1/files", headers=headers, data={"purpose": "fine-tune"},
                   files={"file": ("rows.jsonl", body)})
    assert r.status_code == 200, r.text
    ds = r.json()["id"]
    # the dataset validates in a worker, and there is none: its event stream stays open
    host, port = base.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(f"GET /datasets/{ds}/events HTTP/1.1\r\nHost: {host}:{port}\r\n"
                 f"Authorization: {headers['Authorization']}\r\nAccept: text/event-stream\r\n\r\n"
                 .encode())
    conn.settimeout(10)
    assert b"200 OK" in conn.recv(4096)  # the stream is open
    try:
        web["proc"].send_signal(signal.SIGTERM)
        t = time.monotonic()
        web["proc"].wait(30)
        assert time.monotonic() - t < 12, "the web waited for the open stream"
    finally:
        conn.close()


def test_sigterm_stops_the_web_within_seconds_with_a_request_in_flight(web) -> None:  # noqa: F811
    """A request still in progress (an upload whose body stops arriving, as a stalled client
    or a long streaming answer) no longer holds the shutdown until the client gives up."""
    base, headers = web["base"], web["headers"]
    host, port = base.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {host}:{port}\r\n"
                 f"Authorization: {headers['Authorization']}\r\nContent-Length: 1000000\r\n"
                 "Content-Type: multipart/form-data; boundary=xyz\r\n\r\n--xyz\r\n".encode())
    time.sleep(1.0)  # the request is being served, its body incomplete
    try:
        web["proc"].send_signal(signal.SIGTERM)
        t = time.monotonic()
        web["proc"].wait(60)
        assert time.monotonic() - t < 12, "the web waited for the request in flight"
    finally:
        conn.close()
