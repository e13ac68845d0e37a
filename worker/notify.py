"""Run notifications: when a run's training job ends (succeeded, failed or cancelled) the worker
POSTs JSON about it to the run owner's webhook URL (``users.webhook_url``, set on the account
page or ``PUT /api/me/webhook``; :mod:`app.studio.notify` validates it).

Each delivery is signed with the owner's secret (Standard Webhooks headers ``webhook-id``,
``webhook-timestamp``, ``webhook-signature``: :func:`app.studio.notify.signature_headers`); a
webhook set before signing existed has no secret and is not sent to (a warning says to save it
again). The host is resolved again at each delivery and an internal address (loopback, private,
link-local, ...) is refused unless the setting ``webhook_allow_private`` allows it; the POST
goes to the address that was checked (no second lookup), and a redirect is not followed.

The POST runs in a daemon thread after the job's end is recorded, with a short timeout, so it
never delays or fails the job; its outcome is a log line of the run (a failure a warning).
A job process (``worker/child.py``) waits for it, at most :data:`TIMEOUT_SECONDS` + 1 s, before
it exits (:func:`wait`).

Body: ``{"event": "run.finished", "run_id", "name", "kind", "state", "job_id", "error",
"finished_at", "metrics", "url"}``; ``metrics`` holds the result's steps and losses (rewards for
GRPO) or, for a run that did not succeed, its newest training step and loss.
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from app.store import events, queue, repo
from app.store.db import session_scope
from app.store.schema import JobState, User
from app.studio import notify as rules

log = logging.getLogger("worker.notify")

#: Seconds the POST may take (connect + answer).
TIMEOUT_SECONDS = 5.0
#: Job kinds whose end is a run's end.
RUN_KINDS = ("train", "grpo")
#: Result keys sent as ``metrics``.
METRIC_KEYS = ("steps", "first_loss", "final_loss", "train_loss", "train_runtime",
               "first_reward", "final_reward", "first_rewards_mean", "last_rewards_mean")

_threads: list[threading.Thread] = []


class Delivery:
    """One webhook POST: the ``url``, the owner's signing ``secret`` (None: set before signing
    existed) and the JSON ``body``."""

    def __init__(self, url: str, secret: str | None, body: dict[str, Any]):
        self.url, self.secret, self.body = url, secret, body


def payload(engine, job_id: int) -> Delivery | None:
    """The delivery for an ended run job whose owner has a webhook, else None."""
    job = queue.get_job(engine, job_id)
    if job.kind not in RUN_KINDS or not job.run_id or job.state not in JobState.FINAL:
        return None
    try:
        run = repo.get_run(engine, job.run_id)
    except repo.NotFound:
        return None
    with session_scope(engine) as s:
        owner = s.get(User, run.owner) if run.owner else None
        if owner is None or owner.disabled or not owner.webhook_url:
            return None
        url, secret = owner.webhook_url, owner.webhook_secret
    result = job.result or {}
    metrics = {k: result[k] for k in METRIC_KEYS if result.get(k) is not None}
    if not metrics:
        for ev in events.recent(engine, job.id, "metric", 20):
            if isinstance(ev.data.get("loss"), (int, float)):
                metrics = {"step": ev.data.get("step"), "loss": ev.data["loss"]}
                break
    if isinstance(result.get("eval"), dict):
        metrics["best_eval_loss"] = result["eval"].get("best_eval_loss")
    return Delivery(url, secret, {
        "event": "run.finished", "run_id": run.id, "name": run.name, "kind": run.kind,
        "state": job.state, "job_id": job.id, "error": job.error,
        "finished_at": job.finished_at, "metrics": metrics, "url": f"/runs/{run.id}"})


class Refused(Exception):
    """The webhook's host is (now) an internal address, or it has no signing secret."""


class _Pinned(http.client.HTTPConnection):
    """HTTP to ``host`` (its Host header) through the already checked address ``ip``."""

    def __init__(self, host: str, port: int, ip: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.ip = ip

    def connect(self) -> None:
        self.sock = socket.create_connection((self.ip, self.port), self.timeout)


class _PinnedTLS(_Pinned):
    """HTTPS to ``host`` (certificate checked for that name) through the address ``ip``."""

    default_port = http.client.HTTPS_PORT

    def connect(self) -> None:
        super().connect()
        self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)


def send(delivery: Delivery, msg_id: str, allow_private: bool,
         timeout: float = TIMEOUT_SECONDS) -> tuple[int, str]:
    """POST ``delivery`` signed (``msg_id``: its ``webhook-id``); returns (HTTP status, reason).
    Raises Refused (no secret; the host resolves to an internal address and ``allow_private``
    is off), OSError / http.client errors when it cannot be reached."""
    if not delivery.secret:
        raise Refused("the webhook has no signing secret (it was set before deliveries were "
                      "signed); save it again on the account page to get one")
    parts = urlsplit(delivery.url)
    tls = parts.scheme.lower() == "https"
    port = parts.port or (443 if tls else 80)
    addresses = rules.resolve(parts.hostname, port, timeout)
    if not addresses:
        raise OSError(f"{parts.hostname} resolves to no address")
    if not allow_private:
        why = rules.internal_target(parts.hostname, addresses)
        if why is not None:
            raise Refused(f"{why}, an internal address (an admin may allow them with "
                          f"{rules.ALLOW_SETTING})")
    body = json.dumps(delivery.body).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "whetstone-webhook/2",
               **rules.signature_headers(delivery.secret, msg_id, int(time.time()), body)}
    conn = (_PinnedTLS if tls else _Pinned)(parts.hostname, port, addresses[0], timeout)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", target, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.reason
    finally:
        conn.close()


def _post(engine, job_id: int, delivery: Delivery, allow_private: bool) -> None:
    url = delivery.url
    try:
        status, reason = send(delivery, f"msg_job{job_id}", allow_private)
        if status < 300:
            msg, level = f"webhook: POST {url} answered {status}", "info"
        else:
            why = " (redirects are not followed)" if status < 400 else ""
            msg, level = f"webhook: POST {url} failed: HTTP {status} {reason}{why}", "warning"
    except Refused as exc:
        msg, level = f"webhook: POST {url} refused: {exc}", "warning"
    except Exception as exc:  # noqa: BLE001 - a notification must never fail anything
        msg, level = f"webhook: POST {url} failed: {exc}", "warning"
    try:
        events.append_many(engine, job_id, [("log", {"level": level, "message": msg})])
    except Exception:  # noqa: BLE001
        log.exception("job %s: could not record the webhook's outcome", job_id)


def run_ended(engine, job_id: int, settings=None) -> threading.Thread | None:
    """POST the end of run job ``job_id`` to its owner's webhook in a daemon thread (started and
    returned); None when there is nothing to send (not a run job, no webhook). ``settings``:
    the worker's (``webhook_allow_private``; None: the process settings). Never raises."""
    try:
        if settings is None:
            from app.settings import get_settings

            settings = get_settings()
        found = payload(engine, job_id)
    except Exception:  # noqa: BLE001
        log.exception("job %s: could not build the webhook notification", job_id)
        return None
    if found is None:
        return None
    t = threading.Thread(target=_post, daemon=True,
                         args=(engine, job_id, found, settings.webhook_allow_private),
                         name=f"webhook-{job_id}")
    t.start()
    _threads[:] = [x for x in _threads if x.is_alive()] + [t]
    return t


def wait(timeout: float = TIMEOUT_SECONDS + 1.0) -> None:
    """Wait (at most ``timeout`` seconds in all) for the notifications still being sent."""
    end = time.monotonic() + timeout
    for t in list(_threads):
        t.join(max(0.0, end - time.monotonic()))
