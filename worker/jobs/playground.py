"""The ``playground`` job: one user's chat session with one model, kept loaded while it is used.

Payload (written by :func:`app.studio.playground.open_session`): ``target`` (``adapter``,
``base`` or ``gguf``), ``model`` (the public id, e.g. ``stories260K:ft:ftjob-…``), ``model_id``
(the base model's row), ``run_id``, ``checkpoint_step`` (None: the final adapter),
``artifact_id`` (a GGUF export's file), ``sides``, ``template_name`` / ``template`` (the run's
own, chosen when the run was created) and ``idle_seconds``.

The job loads the model once and writes a ``session`` event (``status`` ``ready``, ``loads``:
how many times this session loaded it, ``load_seconds``, ``device``). Then it reads ``prompt``
events the web appends to its own event stream (``request_id``, ``messages`` per side,
``params``) and answers each side in turn, interleaved token by token: ``token`` events
(``request_id``, ``side``, ``text``: the new text, written at most every
:data:`FLUSH_SECONDS`) and one ``answer`` event per side (``text``, ``finish_reason``,
``usage``, ``first_token_seconds``, ``tokens_per_second``, ``loads``, or ``error``). A
``cancel`` event (``request_id``: the page's Stop button, a ``/v1`` caller who went away) ends
that prompt's answers at the next flush with the text so far and ``finish_reason`` ``stopped``
(a prompt not yet begun: empty). After
``idle_seconds`` without a prompt the job ends (succeeded) and frees its GPU slot; cancel ends it
at once. Sooner, after ``yield_seconds`` without a prompt, it ends when a queued job waits for the
slot it holds (:func:`app.studio.playground.waiting_for`, checked every
:data:`YIELD_CHECK_SECONDS`): its last ``session`` event then has ``status`` ``ended``, ``reason``
``yielded``, the queued job's id ``for_job`` and the ``message`` the chat shows.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from app.store import events, repo
from worker import gpu
from worker.context import JobContext, JobError

#: Seconds between two reads of the session's new prompts while idle.
POLL_SECONDS = 0.05
#: Seconds between two checks, while idle past ``yield_seconds``, for a job waiting for the slot.
YIELD_CHECK_SECONDS = 1.0
#: Longest time text waits before it is written as a ``token`` event (seconds).
FLUSH_SECONDS = 0.05


def _adapter_dir(ctx: JobContext, run_id: str, step: int | None) -> str:
    """The folder of the run's final adapter or of its checkpoint ``step``. Raises JobError."""
    if step is not None:
        for a in repo.list_artifacts(ctx.engine, run_id, kind="checkpoint"):
            if (a.meta or {}).get("step") == step and Path(a.path, "adapter_config.json").is_file():
                return a.path
        raise JobError(f"run {run_id} has no checkpoint at step {step} on disk")
    for a in repo.list_artifacts(ctx.engine, run_id, kind="adapter"):
        folder = (a.meta or {}).get("folder")
        if folder and Path(folder, "adapter_config.json").is_file():
            return folder
    folder = ctx.settings.data_dir / "runs" / run_id / "adapter"
    if (folder / "adapter_config.json").is_file():
        return str(folder)
    raise JobError(f"run {run_id} has no adapter on disk (has its training finished?)")


def load(ctx: JobContext, p: dict[str, Any]):
    """The session's model (:class:`worker.engine.chat.Loaded`). Raises JobError."""
    from worker.engine import chat

    cuda = gpu.cuda_available()
    try:
        if p["target"] == "gguf":
            art = repo.get_artifact(ctx.engine, p["artifact_id"])
            return chat.load_gguf(art.path, cuda)
        model_row = repo.get_model(ctx.engine, p["model_id"])
        if model_row.status != "ready" or not model_row.path:
            raise JobError(f"model {model_row.name} is not ready (status {model_row.status})")
        adapter = _adapter_dir(ctx, p["run_id"], p.get("checkpoint_step")) \
            if p["target"] == "adapter" else None
        return chat.load_hf(model_row.path, adapter, cuda)
    except repo.NotFound as e:
        raise JobError(f"playground: {e}") from None
    except (OSError, ValueError) as e:
        raise JobError(f"could not load {p.get('model')}: {' '.join(str(e).split())[:300]}") \
            from e


def stopped(ctx: JobContext, request_id: str, after: int) -> bool:
    """Whether the web asked to stop the answer to ``request_id`` (a ``cancel`` event after
    the prompt's event id ``after``; :func:`app.studio.playground.stop_prompt`)."""
    return any(e.data.get("request_id") == request_id
               for e in events.since(ctx.engine, ctx.job.id, after, 1000, types=["cancel"]))


def answer(ctx: JobContext, loaded, p: dict[str, Any], prompt: dict[str, Any],
           loads: int, after: int = 0) -> None:
    """Answer one ``prompt`` event (its event id ``after``) on every side it names, token
    events as text comes; a stopped prompt (:func:`stopped`, checked at every flush) ends each
    side with the text so far and ``finish_reason`` ``stopped``."""
    from app.data.errors import DatasetError
    from worker.engine import chat

    rid = prompt.get("request_id")
    params = chat.Params(**{k: v for k, v in (prompt.get("params") or {}).items()
                            if k in chat.Params.__dataclass_fields__})
    streams, out = [], []
    skip = stopped(ctx, rid, after)
    for side, messages in (prompt.get("messages") or {}).items():
        if side not in p["sides"]:
            continue
        if skip:  # stopped before it began
            out.append(("answer", {"request_id": rid, "side": side, "text": "",
                                   "finish_reason": "stopped", "loads": loads,
                                   "usage": {"prompt_tokens": 0, "completion_tokens": 0,
                                             "total_tokens": 0}}))
            continue
        try:
            ids = chat.prompt_ids(loaded, chat.render_prompt(loaded, messages, p.get("template")))
        except DatasetError as e:
            out.append(("answer", {"request_id": rid, "side": side, "error": str(e),
                                   "loads": loads}))
            continue
        if len(ids) >= loaded.context:
            out.append(("answer", {"request_id": rid, "side": side, "loads": loads,
                                   "error": f"the conversation is {len(ids)} tokens, as long as "
                                   f"the model's context ({loaded.context}) or longer: start a "
                                   "new conversation"}))
            continue
        streams.append(chat.Stream(loaded, side, ids, params))
    if out:
        events.append_many(ctx.engine, ctx.job.id, out)
    last_flush = time.monotonic()
    while streams:
        ctx.check()
        for s in streams:
            s.step()
        now = time.monotonic()
        if now - last_flush >= FLUSH_SECONDS and stopped(ctx, rid, after):
            for s in streams:
                if not s.done:
                    s.done, s.finish_reason = True, "stopped"
        finished = [s for s in streams if s.done]
        if finished or now - last_flush >= FLUSH_SECONDS:
            batch = [("token", {"request_id": rid, "side": s.side, "text": t})
                     for s in streams if (t := s.take())]
            for s in finished:
                took = max(1e-9, now - s.started - (s.first_token_seconds or 0.0))
                batch.append(("answer", {
                    "request_id": rid, "side": s.side, "text": s.text,
                    "finish_reason": s.finish_reason,
                    "usage": {"prompt_tokens": s.prompt_tokens,
                              "completion_tokens": s.completion_tokens,
                              "total_tokens": s.prompt_tokens + s.completion_tokens},
                    "first_token_seconds": s.first_token_seconds,
                    "tokens_per_second": round(max(0, s.completion_tokens - 1) / took, 2),
                    "loads": loads}))
            events.append_many(ctx.engine, ctx.job.id, batch)
            last_flush = now
            streams = [s for s in streams if not s.done]


def yield_to(ctx: JobContext, idle_for: float) -> int | None:
    """When a queued job waits for this session's slot: say so (a ``session`` event the chat
    shows, a log line) and return that job's id, so the session ends; else None."""
    from app.studio import playground as pg

    waiting = pg.waiting_for(ctx.engine, ctx.settings, ctx.job.id)
    if waiting is None:
        return None
    what = "GPU" if gpu.cuda_available() else "worker slot"
    message = pg.YIELDED.format(what=what)
    events.append_many(ctx.engine, ctx.job.id, [("session", {
        "status": "ended", "reason": "yielded", "for_job": waiting.id, "message": message})])
    ctx.log(f"idle for {idle_for:.0f}s while job {waiting.id} ({waiting.kind}) waits for this "
            f"{what}: the session ends to free it")
    return waiting.id


def run(ctx: JobContext) -> dict[str, Any]:
    """Serve the session in ``ctx.payload`` until it has been idle ``idle_seconds`` (see the
    module docstring). Returns ``{"prompts", "loads", "load_seconds", "ended"}``."""
    p = dict(ctx.payload)
    idle = float(p.get("idle_seconds") or 300)
    earlier = events.since(ctx.engine, ctx.job.id, 0, 100000, types=["session", "answer"])
    answered = {e.data.get("request_id") for e in earlier if e.type == "answer"}
    loads = 1 + sum(1 for e in earlier if e.type == "session" and e.data.get("status") == "ready")
    ctx.progress("load", 0, 1, f"loading {p.get('model')}")
    t0 = time.monotonic()
    loaded = load(ctx, p)
    load_seconds = round(time.monotonic() - t0, 3)
    ctx.progress("load", 1, 1)
    events.append_many(ctx.engine, ctx.job.id, [("session", {
        "status": "ready", "loads": loads, "load_seconds": load_seconds,
        "device": gpu.device_name(), "sides": p["sides"], "model": p.get("model"),
        "template_name": p.get("template_name"), "idle_seconds": idle})])
    ctx.log(f"{p.get('model')} loaded in {load_seconds:.1f}s on {gpu.device_name()}; the "
            f"session ends after {idle:g}s without a prompt")
    grace = float(p["yield_seconds"] if p.get("yield_seconds") is not None
                  else ctx.settings.playground_yield_seconds)
    after, served = 0, 0
    last = time.monotonic()
    deadline, next_check = last + idle, last + grace
    while True:
        ctx.check()
        prompts = events.since(ctx.engine, ctx.job.id, after, 20, types=["prompt"])
        if not prompts:
            t = time.monotonic()
            if t >= deadline:
                break
            if t >= next_check:
                next_check = t + YIELD_CHECK_SECONDS
                waiting = yield_to(ctx, t - last)
                if waiting is not None:
                    return {"prompts": served, "loads": loads, "load_seconds": load_seconds,
                            "ended": "yielded", "for_job": waiting, "memory_peak": gpu.peak()}
            time.sleep(POLL_SECONDS)
            continue
        for ev in prompts:
            after = ev.id
            if ev.data.get("request_id") in answered:
                continue
            answer(ctx, loaded, p, ev.data, loads, ev.id)
            answered.add(ev.data.get("request_id"))
            served += 1
        last = time.monotonic()
        deadline, next_check = last + idle, last + grace
    ctx.log(f"session idle for {idle:g}s: ended after {served} prompt{'s' if served != 1 else ''}")
    return {"prompts": served, "loads": loads, "load_seconds": load_seconds, "ended": "idle",
            "memory_peak": gpu.peak()}
