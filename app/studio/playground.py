"""The playground: chat with a run's model (final adapter or any checkpoint) beside its base, with
an exported GGUF through llama.cpp, or with a base model, and the same through
``/v1/chat/completions``.

A *session* is a queue job of kind ``playground`` (worker/jobs/playground.py) owned by its user:
it loads the model once, keeps it loaded until ``settings.playground_idle_seconds`` pass without
a prompt, and counts in GPU admission with :func:`estimate_gib`; idle for
``settings.playground_yield_seconds`` while a queued job waits for its slot
(:func:`waiting_for`), it ends sooner and says so. A user's live session for a model is reused
(:func:`open_session`, race-free). A prompt's answer can be stopped (:func:`stop_prompt`). The database is the only channel: a prompt is a
``prompt`` event the web appends to the session's job events; the worker answers with ``token``
and ``answer`` events (see the worker module), which the web relays.

Model ids (what ``/v1/models`` lists, plus a suffix for checkpoints and GGUF files):
``stories260K`` (a base model), ``stories260K:ft:<run id>`` (the run's final adapter; its base
is the other pane), ``…:ft:<run id>:checkpoint-<step>`` (a checkpoint on disk; ``…:ckpt-step-<step>``,
the OpenAI checkpoints API's id, names the same one) and
``…:ft:<run id>:<artifact id>`` (a GGUF export, served by llama.cpp as Ollama would).

The chat template is the run's own (``spec.chat_template`` / ``chat_template_name``, chosen when
the run was created); a base model's is chosen as a new run's would be
(:func:`app.data.chat_template.choose_template`), once, when its session opens.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from app.settings import Settings
from app.store import events, queue, repo
from app.store.db import session_scope
from app.store.schema import Artifact, Job, JobEvent, JobState, Model, Run, now
from app.studio import access, calibration
from app.studio import checkpoint_eval as ckpt_eval
from app.studio.datasets import context_window
from app.studio.errors import StudioError, invalid
from app.studio.job_states import state_words
from app.studio.jobs import visible_jobs
from app.studio.run_place import run_place
from app.studio.estimate import GIB, lora_params, model_shape, weight_bytes
from app.studio.playground_params import (  # noqa: F401 - part of the playground's API
    DEFAULT_MAX_TOKENS, DEFAULTS, LIMITS, MAX_TOKENS, ROLES, messages, params, prompt_params)
from app.studio.playground_targets import targets  # noqa: F401 - the page's model picker
from app.studio.playground_answers import (  # noqa: F401 - part of the playground's API
    abandon_prompt, cancel_prompt, poll_answer)

if TYPE_CHECKING:
    from app.store.schema import User

KIND = "playground"
SIDE_LABELS = {"fine_tuned": "Fine-tuned", "base": "Base", "gguf": "GGUF (llama.cpp)"}
#: Context the memory estimate reserves a KV cache for (tokens; less when the model's is less).
ESTIMATE_CONTEXT = 4096
#: Working memory of a decode step besides the cache and logits (GiB): buffers, GEMM workspace.
STEP_GIB = 0.2


@dataclass
class Target:
    """What a session serves: ``target`` ``adapter`` | ``base`` | ``gguf``; ``model`` the public
    id; ``sides`` the panes (``fine_tuned`` + ``base``, ``base`` or ``gguf``); ``template`` the
    chat template source (None: prompts sent as they are) and its ``template_name``."""

    target: str
    model: str
    model_row: Model
    sides: list[str]
    template_name: str | None
    template: str | None
    run: Run | None = None
    checkpoint_step: int | None = None
    artifact: Artifact | None = None
    system_prompt: str | None = None
    notes: list[str] = field(default_factory=list)

    def payload(self, idle_seconds: float, yield_seconds: float | None = None
                ) -> dict[str, Any]:
        """The session job's payload (see worker/jobs/playground.py); seconds."""
        return {"target": self.target, "model": self.model, "model_id": self.model_row.id,
                "run_id": self.run.id if self.run else None,
                "checkpoint_step": self.checkpoint_step,
                "artifact_id": self.artifact.id if self.artifact else None,
                "sides": self.sides, "template_name": self.template_name,
                "template": self.template, "idle_seconds": idle_seconds,
                "yield_seconds": yield_seconds}


def _no_model(model: str) -> StudioError:
    return StudioError("not_found", f"The model {model!r} does not exist: GET /v1/models lists "
                       "the base models and the fine-tuned models you may use", "model",
                       "model_not_found")


def _run_template(run: Run) -> tuple[str | None, str | None]:
    spec = run.spec or {}
    name = spec.get("chat_template_name")
    if name == "none":
        return name, None
    return name, spec.get("chat_template")


def resolve(engine: Engine, actor: User, model: str) -> Target:
    """The :class:`Target` a model id names, if ``actor`` may use it (see the module docstring).

    Raises StudioError: ``not_found`` (field ``model``, code ``model_not_found``) for an unknown
    id or another user's, or a checkpoint not on disk (the message lists those on disk);
    ``invalid`` for a malformed one; ``conflict`` for a run that has not
    finished (name a checkpoint instead) or a base model that is not ready."""
    if not isinstance(model, str) or not model.strip():
        raise invalid("model", "name a model (GET /v1/models lists them)")
    model = model.strip()
    base, sep, rest = model.partition(":ft:")
    if not sep:
        try:
            row = access.model(engine, actor, model)
        except StudioError:
            raise _no_model(model) from None
        if row.status != "ready":
            raise StudioError("conflict", f"model {row.name!r} is not ready (status "
                              f"{row.status})", "model", "model_not_ready")
        from app.data.chat_template import choose_template
        from app.data.errors import DatasetError

        try:
            name, source = choose_template(None, row.chat_template)
        except DatasetError as e:
            raise invalid("model", f"its chat template cannot be used: {e}") from None
        return Target("base", model, row, ["base"], name, source)
    run_id, _, suffix = rest.partition(":")
    try:
        run, job = access.run_with_job(engine, actor, run_id)
        row = repo.get_model(engine, run.model_id)
    except (StudioError, repo.NotFound):
        raise _no_model(model) from None
    if row.name != base:
        raise _no_model(model)
    name, source = _run_template(run)
    t = Target("adapter", model, row, ["fine_tuned", "base"], name, source, run,
               system_prompt=(run.spec or {}).get("system_prompt"))
    if not suffix:
        if job is None or job.state != JobState.SUCCEEDED:
            raise StudioError("conflict", f"run {run.id} has not finished training (it "
                              f"{state_words(job.state if job else 'queued')}); chat with "
                              "one of its checkpoints instead (…:checkpoint-<step>)", "model",
                              "run_not_finished")
        return t
    if suffix.startswith(("checkpoint-", "ckpt-step-")):
        # ckpt-step-<n>: the id GET /v1/fine_tuning/jobs/{id}/checkpoints lists; one session
        step = suffix.removeprefix("checkpoint-").removeprefix("ckpt-step-")
        if not (step.isascii() and step.isdigit()) or len(step) > 18:  # "²": isdigit, no int
            raise _no_model(model)
        t.model = f"{base}:ft:{run_id}:checkpoint-{int(step)}"
        missing = ckpt_eval.not_on_disk(engine, run.id, int(step), field="model",
                                        code="model_not_found")
        if missing is not None:
            raise missing
        t.checkpoint_step = int(step)
        return t
    art = next((a for a in repo.list_artifacts(engine, run.id, kind="gguf") if a.id == suffix),
               None)
    if art is None:
        raise _no_model(model)
    t.target, t.sides, t.artifact = "gguf", ["gguf"], art
    return t


def estimate_gib(t: Target) -> float | None:
    """GPU allocator peak of a session in GiB: the base weights in bf16 (a GGUF: its file),
    the adapter, a KV cache of :data:`ESTIMATE_CONTEXT` tokens for each side at once and the
    prefill's logits; None when the model's shape is unknown (the session then runs alone)."""
    shape = model_shape(t.model_row.info, t.model_row.path)
    if shape is None:
        return None
    ctx = min(ESTIMATE_CONTEXT, context_window(t.model_row) or ESTIMATE_CONTEXT)
    kv = ctx * shape.layers * 2 * shape.kv_heads * shape.head_dim * 2 * len(t.sides)
    logits = ctx * shape.vocab * 2 + 2 * shape.vocab * 4
    if t.artifact is not None:
        weights = float(t.artifact.bytes or 0)
    else:
        weights = weight_bytes(shape, False)
        if t.run is not None:
            spec = t.run.spec or {}
            weights += 2 * lora_params(shape, int(spec.get("r") or 16),
                                       list(spec.get("target_modules") or []))
    return round((weights + kv + logits) / GIB + STEP_GIB, 3)


# ---- sessions --------------------------------------------------------------------------------
def _live(s: Session, actor: User, model: str) -> Job | None:
    jobs = s.exec(select(Job).where(Job.kind == KIND, Job.owner == actor.id,
                                    Job.state.in_([JobState.QUEUED, JobState.RUNNING]),
                                    Job.cancel_requested == False)  # noqa: E712
                  .order_by(Job.id.desc())).all()
    for j in jobs:
        if (j.payload or {}).get("model") != model:
            continue
        ending = s.exec(select(JobEvent.data).where(JobEvent.job_id == j.id,
                                                    JobEvent.type == "session")
                        .order_by(JobEvent.id.desc()).limit(1)).first()
        if (ending or {}).get("status") != "ended":  # not giving its slot up
            return j
    return None


def open_session(engine: Engine, settings: Settings, actor: User, model: str,
                 prompt: dict[str, Any] | None = None) -> tuple[Job, bool]:
    """``(session, reused)``: the caller's live session for ``model`` (queued or running, not
    ending), or a new one queued with its memory estimate; the look and the insert are one
    write transaction, so concurrent calls (a client's retry) never open two. ``prompt``: the
    prompt about to be sent (its sampling :func:`prompt_params` are checked first, so a bad one
    queues no session). Raises StudioError as :func:`resolve` and :func:`params`, and invalid
    (code ``over_gpu_memory_quota``) when the caller's GPU memory quota could never admit the
    session (:func:`app.studio.calibration.check_job_quota`) and no session of theirs for
    ``model`` already runs (one started before an admin lowered the quota keeps serving)."""
    if prompt is not None:
        prompt_params(prompt)
    t = resolve(engine, actor, model)
    need = estimate_gib(t)
    try:
        calibration.check_job_quota(engine, settings, actor, need, 1,
                                    f"a Playground session of {t.model}", calibration.QUOTA_REMEDY)
    except StudioError:
        with session_scope(engine) as s:
            live = _live(s, actor, t.model)
        if live is None or live.state != JobState.RUNNING:
            raise
        return live, True
    return queue.enqueue_unless(
        engine, KIND, t.payload(settings.playground_idle_seconds,
                                settings.playground_yield_seconds),
        lambda s: _live(s, actor, t.model), run_id=t.run.id if t.run else None,
        owner=actor.id, estimate_gib=need, max_attempts=1)


def sessions_using(engine: Engine, artifact_ids: list[str]) -> list[Job]:
    """The queued or running sessions (anyone's) that serve one of ``artifact_ids`` (a GGUF
    export's files), oldest first."""
    if not artifact_ids:
        return []
    with session_scope(engine) as s:
        jobs = s.exec(select(Job).where(Job.kind == KIND, Job.state.in_(
            [JobState.QUEUED, JobState.RUNNING])).order_by(Job.id)).all()
    return [j for j in jobs if (j.payload or {}).get("artifact_id") in artifact_ids]


def session(engine: Engine, actor: User, session_id: int | str) -> Job:
    """The playground session ``session_id`` if ``actor`` owns it (an admin: any).
    Raises StudioError not_found (another user's session too)."""
    try:
        ident = int(str(session_id))
    except ValueError:
        ident = 0
    gone = StudioError("not_found", "no playground session of yours has this id")
    if not 0 < ident < 2**63:
        raise gone
    try:
        return access.job(engine, actor, ident, kind=KIND)
    except StudioError:
        raise gone from None


def list_sessions(engine: Engine, settings: Settings, actor: User,
                  limit: int) -> list[dict[str, Any]]:
    """The ``limit`` newest Playground sessions ``actor`` may open with :func:`session` (an
    admin: every user's, as every list), newest first, each as :func:`session_info`."""
    return [session_info(engine, settings, actor, j)
            for j in visible_jobs(engine, actor, KIND, limit)]


def status_of(engine: Engine, job: Job) -> str:
    """``queued`` (waiting for a GPU), ``loading``, ``ready`` or ``ended`` (also once the
    worker said it is ending: it gave its slot up to a queued job)."""
    if job.state in JobState.FINAL or job.cancel_requested:
        return "ended"
    if job.state == JobState.QUEUED:
        return "queued"
    latest = events.latest(engine, job.id, "session")
    if latest is None:
        return "loading"
    return "ended" if (latest.data or {}).get("status") == "ended" else "ready"


def session_info(engine: Engine, settings: Settings, actor: User, job: Job) -> dict[str, Any]:
    """A session (``actor`` may see it: the caller checked) as the API shows it: ``id``,
    ``object`` (``playground.session``), ``model``, ``status`` (:func:`status_of`), ``state``
    (the job's), ``sides``, ``template_name``, ``template``, ``idle_seconds``, ``loads``,
    ``load_seconds``, ``device``, ``estimate_gib``, ``error``, ``ended`` (None, ``idle``,
    ``yielded``: it freed its slot for a queued job), ``message`` (what the chat says about its
    end), ``events_url``, and ``queue``: while the status is ``queued``, where it waits as the
    Queue page says it (:func:`app.studio.run_place.run_place`): ``position`` (1 = next; None
    when the queue does not list it), ``reason``, ``start_in_seconds`` (estimated start; None:
    unknown) and ``text`` (all of it in one sentence); else None."""
    p = job.payload or {}
    status = status_of(engine, job)
    wait = None
    if status == "queued":
        place = run_place(engine, settings, actor, job)
        wait = {"position": place.position, "reason": place.reason,
                "start_in_seconds": place.start_in_seconds, "text": place.text}
    r = {}
    for ev in events.since(engine, job.id, 0, 100, types=["session"]):
        r = {**r, **(ev.data or {})}
    ended = (job.result or {}).get("ended") or (r.get("reason") if r.get("status") == "ended"
                                                 else None)
    return {"id": job.id, "object": "playground.session", "model": p.get("model"),
            "run_id": p.get("run_id"), "checkpoint_step": p.get("checkpoint_step"),
            "status": status, "state": job.state, "sides": p.get("sides"),
            "template_name": p.get("template_name"), "template": p.get("template"),
            "idle_seconds": p.get("idle_seconds"), "loads": r.get("loads", 0),
            "load_seconds": r.get("load_seconds"), "device": r.get("device"),
            "estimate_gib": job.estimate_gib, "error": job.error, "created_at": job.created_at,
            "ended": ended, "message": r.get("message"), "queue": wait,
            "events_url": f"/api/playground/sessions/{job.id}/events"}


#: What an idle session says in the chat when it gave its slot up to a queued job.
YIELDED = ("The session was ended to free the {what} for a queued job; the next message starts "
           "a new one.")


def waiting_for(engine: Engine, settings: Settings, job_id: int) -> Job | None:
    """The queued job that waits for the slot the running session ``job_id`` holds (admission
    refuses it now and would admit it once the session ended, :func:`app.store.admission.waits_for`),
    or None. A session a plain worker claimed (no admission slot) holds that worker: a queued
    job of a slot kind waits for it when every other live worker of the main lane is busy too.
    The worker calls it while a session is idle (worker/jobs/playground.py)."""
    from app.store import admission, workers
    from app.studio.queue_cpu import LANE_SUFFIX
    from app.studio.queue_view import GPU_KINDS

    kinds = GPU_KINDS
    live = workers.live(engine, settings.worker_stale_seconds)
    with session_scope(engine) as s:
        job = s.get(Job, job_id)
        if job is None or job.state != JobState.RUNNING:
            return None
        if job.gpu_slot:
            snap = admission.snapshot(s, now(), kinds, settings.gpu_admit_margin,
                                      settings.fair_share_hours)
            return admission.waits_for(snap, job, admission.slots_of(live))
        waiting = s.exec(select(Job).where(Job.state == JobState.QUEUED,
                                           Job.kind.in_(kinds),
                                           Job.cancel_requested == False)  # noqa: E712
                         .order_by(Job.id)).first()
        if waiting is None:
            return None
        busy = set(s.exec(select(Job.lease_owner).where(Job.state == JobState.RUNNING)).all())
    plain = [w for w in live if w.gpu_capacity_gib is None and not w.device.endswith(LANE_SUFFIX)
             and not w.device.startswith("cpu slot")]
    return waiting if all(w.id in busy for w in plain) else None


def stop_session(engine: Engine, actor: User, session_id: int | str) -> Job:
    """End the session now (its model is unloaded, its slot freed). Raises StudioError."""
    return queue.cancel(engine, session(engine, actor, session_id).id)


# ---- prompts ---------------------------------------------------------------------------------
def send_prompt(engine: Engine, actor: User, session_id: int | str,
                body: dict[str, Any]) -> dict[str, Any]:
    """Append a prompt to the caller's session ``session_id``. ``body``: ``messages`` (sent to
    every side of the session, or to ``sides`` when given) or ``messages_by_side`` (side ->
    messages, each side its own history), an optional ``system`` prompt, and the sampling
    :func:`params` ``temperature``, ``top_p``, ``max_tokens``, ``seed``, ``top_k``, ``min_p``,
    ``repetition_penalty``.

    Returns ``{"request_id", "after", "session"}``: the answer's events follow the prompt event
    ``after``. Raises StudioError: not_found (another user's session too, checked first);
    invalid naming the field; conflict (code ``session_ended``) once the session has ended."""
    job = session(engine, actor, session_id)
    sides = list((job.payload or {}).get("sides") or [])
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise invalid("system", "must be a string")
    by_side = body.get("messages_by_side")
    if by_side is not None:
        if not isinstance(by_side, dict) or not by_side:
            raise invalid("messages_by_side", "must be an object: side -> messages")
        unknown = [k for k in by_side if k not in sides]
        if unknown:
            raise invalid("messages_by_side", f"this session answers on {', '.join(sides)}, "
                          f"not {', '.join(map(str, unknown))}")
        checked = {k: messages(v, f"messages_by_side.{k}", system) for k, v in by_side.items()}
    else:
        wanted = body.get("sides") or sides
        if not isinstance(wanted, list) or any(w not in sides for w in wanted):
            raise invalid("sides", f"this session answers on {', '.join(sides)}")
        msgs = messages(body.get("messages"), "messages", system)
        checked = {k: msgs for k in wanted}
    checked_params = prompt_params(body)
    if status_of(engine, job) == "ended":
        raise StudioError("conflict", "this playground session has ended (idle or stopped); "
                          "open a new one", None, "session_ended")
    rid = f"req-{secrets.token_hex(8)}"
    with session_scope(engine, immediate=True) as s:
        ev = events.append(s, job.id, "prompt", {"request_id": rid, "messages": checked,
                                                 "params": checked_params})
        s.flush()
        after = ev.id
    return {"request_id": rid, "after": after, "session": job.id}


def stop_prompt(engine: Engine, actor: User, session_id: int | str, request_id: str) -> dict:
    """Stop the answer to prompt ``request_id`` of the caller's session: a ``cancel`` event the
    worker reads between tokens (it then writes each side's answer so far with
    ``finish_reason`` ``stopped``; a prompt not yet begun is skipped). The session and its
    model stay. Returns ``{"request_id", "session", "stopped"}`` (``stopped`` False when the
    answer had already ended). Raises StudioError not_found (another user's session too, or no
    such prompt in it)."""
    job = session(engine, actor, session_id)
    return cancel_prompt(engine, job.id, request_id)


def leave_prompt(engine: Engine, actor: User, session_id: int | str, request_id: str) -> dict:
    """The page that sent prompt ``request_id`` was closed or left before its answer ended:
    the answer stops as :func:`stop_prompt`'s does, and a session still waiting in the queue
    leaves it when no other prompt waits on it (:func:`abandon_prompt`), so a closed tab
    neither loads a model nor holds a slot for nobody (trial s24 M-3). Returns
    ``{"request_id", "session", "left_queue"}``. Raises StudioError not_found (another user's
    session too, or no such prompt in it)."""
    job = session(engine, actor, session_id)
    return {"request_id": request_id, "session": job.id,
            "left_queue": abandon_prompt(engine, job.id, request_id)}


def context_note(t: Target) -> str:
    """One line on what the panes compare, for the page."""
    if t.target == "gguf":
        return f"{t.artifact.name} through llama.cpp, as Ollama serves it"
    if t.target == "base":
        return f"the base model {t.model_row.name} alone"
    what = f"checkpoint {t.checkpoint_step}" if t.checkpoint_step is not None else "final adapter"
    return (f"the run's {what} beside its base {t.model_row.name} (the same weights with the "
            "adapter switched off)")
