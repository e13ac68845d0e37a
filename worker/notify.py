"""Run notifications: when a run's training job ends (succeeded, failed or cancelled) the worker
POSTs JSON about it to the run owner's webhook URL (``users.webhook_url``, set on the account
page; :mod:`app.studio.notify` validates it).

The POST runs in a daemon thread after the job's end is recorded, with a short timeout, so it
never delays or fails the job; its outcome is a log line of the run (a failure a warning).
A job process (``worker/child.py``) waits for it, at most :data:`TIMEOUT_SECONDS` + 1 s, before
it exits (:func:`wait`).

Body: ``{"event": "run.finished", "run_id", "name", "kind", "state", "job_id", "error",
"finished_at", "metrics", "url"}``; ``metrics`` holds the result's steps and losses (rewards for
GRPO) or, for a run that did not succeed, its newest training step and loss.
"""
from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from app.store import events, queue, repo
from app.store.db import session_scope
from app.store.schema import JobState, User

log = logging.getLogger("worker.notify")

#: Seconds the POST may take (connect + answer).
TIMEOUT_SECONDS = 5.0
#: Job kinds whose end is a run's end.
RUN_KINDS = ("train", "grpo")
#: Result keys sent as ``metrics``.
METRIC_KEYS = ("steps", "first_loss", "final_loss", "train_loss", "train_runtime",
               "first_reward", "final_reward", "first_rewards_mean", "last_rewards_mean")

_threads: list[threading.Thread] = []


def payload(engine, job_id: int) -> tuple[str, dict[str, Any]] | None:
    """(webhook URL, JSON body) for an ended run job whose owner has a webhook, else None."""
    job = queue.get_job(engine, job_id)
    if job.kind not in RUN_KINDS or not job.run_id or job.state not in JobState.FINAL:
        return None
    try:
        run = repo.get_run(engine, job.run_id)
    except repo.NotFound:
        return None
    with session_scope(engine) as s:
        owner = s.get(User, run.owner) if run.owner else None
        url = owner.webhook_url if owner is not None and not owner.disabled else None
    if not url:
        return None
    result = job.result or {}
    metrics = {k: result[k] for k in METRIC_KEYS if result.get(k) is not None}
    if not metrics:
        for ev in events.recent(engine, job.id, "metric", 20):
            if isinstance(ev.data.get("loss"), (int, float)):
                metrics = {"step": ev.data.get("step"), "loss": ev.data["loss"]}
                break
    if isinstance(result.get("eval"), dict):
        metrics["best_eval_loss"] = result["eval"].get("best_eval_loss")
    return url, {"event": "run.finished", "run_id": run.id, "name": run.name, "kind": run.kind,
                 "state": job.state, "job_id": job.id, "error": job.error,
                 "finished_at": job.finished_at, "metrics": metrics, "url": f"/runs/{run.id}"}


def _post(engine, job_id: int, url: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={
        "Content-Type": "application/json", "User-Agent": "whetstone-webhook/1"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_SECONDS) as resp:  # noqa: S310 - http(s) only
            status = resp.status
        msg, level = f"webhook: POST {url} answered {status}", "info"
    except urllib.error.HTTPError as exc:
        msg, level = f"webhook: POST {url} failed: HTTP {exc.code} {exc.reason}", "warning"
    except Exception as exc:  # noqa: BLE001 - a notification must never fail anything
        reason = getattr(exc, "reason", None) or exc
        msg, level = f"webhook: POST {url} failed: {reason}", "warning"
    try:
        events.append_many(engine, job_id, [("log", {"level": level, "message": msg})])
    except Exception:  # noqa: BLE001
        log.exception("job %s: could not record the webhook's outcome", job_id)


def run_ended(engine, job_id: int) -> threading.Thread | None:
    """POST the end of run job ``job_id`` to its owner's webhook in a daemon thread (started and
    returned); None when there is nothing to send (not a run job, no webhook). Never raises."""
    try:
        found = payload(engine, job_id)
    except Exception:  # noqa: BLE001
        log.exception("job %s: could not build the webhook notification", job_id)
        return None
    if found is None:
        return None
    t = threading.Thread(target=_post, args=(engine, job_id, *found), daemon=True,
                         name=f"webhook-{job_id}")
    t.start()
    _threads[:] = [x for x in _threads if x.is_alive()] + [t]
    return t


def wait(timeout: float = TIMEOUT_SECONDS + 1.0) -> None:
    """Wait (at most ``timeout`` seconds in all) for the notifications still being sent."""
    import time

    end = time.monotonic() + timeout
    for t in list(_threads):
        t.join(max(0.0, end - time.monotonic()))
