"""``POST /v1/chat/completions``: the OpenAI Chat Completions API, answered by playground sessions.

``model`` is an id ``/v1/models`` lists (a base model such as ``stories260K`` or a fine-tuned
``stories260K:ft:<job id>``; also ``…:checkpoint-<step>`` and a GGUF export, see
:mod:`app.studio.playground`). The caller's live session for that model is reused (the model
stays loaded between requests); otherwise one is queued and the request waits while a worker
loads it. A fine-tuned id answers with the adapter on; a base id with the base alone. A caller
who disconnects (while its session waits for a GPU, loads or answers) stops the wait and the
answer; its retry reuses the same session.

``stream: true`` sends ``chat.completion.chunk`` server-sent events (the role first, then the
content deltas, the ``finish_reason``, with ``stream_options.include_usage`` a usage chunk) and
``data: [DONE]``; otherwise one ``chat.completion`` with ``usage``. Supported: ``messages``
(system / user / assistant, text), ``temperature`` (0-2), ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``seed``, ``n`` = 1, and as vLLM's OpenAI-compatible server the
extra body fields ``top_k`` (0 off), ``min_p`` (0 off), ``repetition_penalty`` (1 off;
openai client: ``extra_body={...}``). Errors use the OpenAI shape (app/web/errors.py):
a bad parameter is 400 naming it, an unknown model 404 ``model_not_found``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.studio import playground as pg
from app.studio.errors import StudioError, invalid
from app.web.api.schemas import json_object
from app.web.auth import still_signed_in
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.openai.shapes import chat_chunk_object, chat_completion_object
from app.web.sse import while_signed_in

router = APIRouter(prefix="/v1")

#: Longest wait for a session to be admitted and load its model, and for its answer (seconds).
WAIT_SECONDS = 600.0
#: Seconds between two reads of the answer's new events.
POLL_SECONDS = 0.05
#: Seconds between two checks that the caller is still connected.
DISCONNECT_CHECK_SECONDS = 0.25


#: OpenAI chat parameters the playground's models do not honour: a request that sets one is a
#: 400 naming it (a false, empty or "none"/"auto" value is the default and is taken).
UNSUPPORTED = {"logprobs": "returning log probabilities is", "top_logprobs": "returning log probabilities is",
               "tools": "tool calling is", "tool_choice": "tool calling is",
               "functions": "function calling is", "function_call": "function calling is",
               "logit_bias": "logit_bias is", "audio": "audio output is",
               "prediction": "predicted outputs are", "stop": "stop sequences are",
               "presence_penalty": "presence_penalty is", "frequency_penalty": "frequency_penalty is"}
#: What to send instead, where the playground has a near equivalent.
INSTEAD = {"presence_penalty": " (repetition_penalty is supported)",
           "frequency_penalty": " (repetition_penalty is supported)"}


def _prompt_body(body: dict[str, Any], side: str) -> dict[str, Any]:
    """The playground prompt of an OpenAI request body, checked (StudioError naming the
    field, with the OpenAI parameter names)."""
    n = body.get("n")
    if n not in (None, 1):
        raise invalid("n", "only n=1 is supported")
    for name, what in UNSUPPORTED.items():  # refused, not ignored: the caller relies on them
        value = body.get(name)
        if value not in (None, False, [], {}, "none", "auto"):
            raise invalid(name, f"{what} not supported here; leave {name} out"
                                f"{INSTEAD.get(name, '')}")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid("response_format", "JSON mode and schemas are not supported here; leave "
                      "response_format out (or send {\"type\": \"text\"})")
    mt_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    try:
        params = pg.prompt_params({**body, "max_tokens": body.get(mt_name)})
    except StudioError as e:
        if e.field == "max_tokens":
            raise invalid(mt_name, e.message) from None
        raise
    pg.messages(body.get("messages"))
    return {"messages_by_side": {side: body["messages"]}, **params}


class Asked:
    """One prompt in flight: its session, request id and the newest event read."""

    def __init__(self, engine, settings, user, model: str, prompt: dict[str, Any], side: str):
        self.engine, self.settings, self.user = engine, settings, user
        self.model, self.prompt, self.side = model, prompt, side
        self.session = self.request_id = None
        self.after = 0
        self.retried = False

    def send(self) -> None:
        """Open (or reuse) the session and append the prompt; a session that ended in between
        (its idle time ran out) is replaced once. Blocking."""
        for attempt in (0, 1):
            job, _ = pg.open_session(self.engine, self.settings, self.user, self.model,
                                     self.prompt)
            try:
                sent = pg.send_prompt(self.engine, self.user, job.id, self.prompt)
            except StudioError as e:
                if e.code == "session_ended" and attempt == 0:
                    continue
                raise
            self.session, self.request_id, self.after = job.id, sent["request_id"], sent["after"]
            return

    def abandon(self) -> None:
        """The caller went away: stop the answer; a session still queued for nobody else leaves
        the queue, a running one stays for the caller's retry (:func:`pg.abandon_prompt`).
        Blocking; never raises (it runs while the request is torn down)."""
        with contextlib.suppress(Exception):
            pg.abandon_prompt(self.engine, self.session, self.request_id)

    async def follow(self, gone: Callable[[], Awaitable[bool]] | None = None
                     ) -> AsyncIterator[tuple[str | None, dict[str, Any] | None]]:
        """Yield ``(text piece, None)`` as tokens come, then ``(None, answer)`` once. Raises
        StudioError unavailable when the session ends unanswered or time runs out, and
        :class:`ClientGone` once ``gone()`` (checked every :data:`DISCONNECT_CHECK_SECONDS`)
        says the caller disconnected; a follow that ends unanswered, however, stops the
        answer (:meth:`abandon`), so no slot works for a caller who is gone."""
        deadline = time.monotonic() + WAIT_SECONDS
        streamed, answered = False, False
        check_at = time.monotonic() + DISCONNECT_CHECK_SECONDS
        try:
            while time.monotonic() < deadline:
                if gone is not None and time.monotonic() >= check_at:
                    check_at = time.monotonic() + DISCONNECT_CHECK_SECONDS
                    if await gone():
                        raise ClientGone()
                pieces, answer, self.after, ended = await run_in_threadpool(
                    pg.poll_answer, self.engine, self.session, self.request_id, self.side,
                    self.after)
                for p in pieces:
                    streamed = True
                    yield p, None
                if answer is not None:
                    answered = True
                    yield None, answer
                    return
                if ended is not None:
                    if not streamed and not self.retried:  # ended before taking it: once more
                        self.retried = True
                        await run_in_threadpool(self.send)
                        continue
                    job = await run_in_threadpool(pg.session, self.engine, self.user,
                                                  self.session)
                    raise StudioError("unavailable", f"the model's session ended ({ended}) "
                                      f"before answering{': ' + job.error if job.error else ''}",
                                      None, "session_ended")
                if not pieces:
                    await asyncio.sleep(POLL_SECONDS)
            raise StudioError("unavailable", f"no answer within {WAIT_SECONDS:g}s: the model's "
                              "session is still waiting for a GPU or loading (see /queue)", None,
                              "timeout")
        finally:
            if not answered:
                self.abandon()


class ClientGone(Exception):
    """The caller of ``/v1/chat/completions`` disconnected while it waited."""


def _answer_error(answer: dict[str, Any]) -> StudioError | None:
    if answer.get("error"):
        return invalid("messages", answer["error"])
    return None


@router.post("/chat/completions")
async def chat_completions(request: Request, engine: EngineDep, settings: SettingsDep,
                           user: CurrentUser):
    body = await json_object(request)
    target = await run_in_threadpool(pg.resolve, engine, user, body.get("model"))
    side = "fine_tuned" if target.target == "adapter" else target.sides[0]
    prompt = _prompt_body(body, side)
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    asked = Asked(engine, settings, user, target.model, prompt, side)
    await run_in_threadpool(asked.send)
    cid, created = f"chatcmpl-{asked.request_id.removeprefix('req-')}", time.time()
    if not body.get("stream"):
        answer = None
        try:
            async for _piece, done in asked.follow(request.is_disconnected):
                answer = done or answer
        except ClientGone:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed")
        err = _answer_error(answer)
        if err:
            raise err
        return chat_completion_object(cid, created, target.model, answer.get("text") or "",
                                      answer.get("finish_reason"), answer.get("usage") or {})

    def sse(obj: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    async def stream() -> AsyncIterator[bytes]:
        yield sse(chat_chunk_object(cid, created, target.model,
                                    {"role": "assistant", "content": ""}))
        try:
            async for piece, answer in asked.follow(request.is_disconnected):
                if piece:
                    yield sse(chat_chunk_object(cid, created, target.model, {"content": piece}))
                if answer is not None:
                    err = _answer_error(answer)
                    if err:
                        raise err
                    yield sse(chat_chunk_object(cid, created, target.model, {},
                                                answer.get("finish_reason") or "stop"))
                    if include_usage:
                        yield sse(chat_chunk_object(cid, created, target.model, None,
                                                    usage=answer.get("usage") or {}))
        except ClientGone:
            return
        except StudioError as e:
            yield sse({"error": {"message": e.message, "type": "server_error"
                                 if e.kind == "unavailable" else "invalid_request_error",
                                 "param": e.field, "code": e.code}})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(while_signed_in(stream(), lambda: still_signed_in(request)),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
