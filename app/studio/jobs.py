"""The queue as a user sees it: every job kind with its state, lane and place in the queue.

A worker process runs two lanes (see worker/loop.py): ``gpu`` (train, grpo) and ``cpu``
(exports, model imports, dataset validation, :data:`app.store.queue.CPU_KINDS`), so a queued job's
position counts only the jobs ahead of it in its own lane, in claim order
(:func:`app.studio.queue_cpu.in_claim_order`: dataset validations first, then priority, then
age; the CPU lane takes turns by owner), across
every user; the list shows the caller's own jobs (an admin's: everyone's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store import queue
from app.store.db import session_scope
from app.store.queue import CPU_KINDS
from app.store.schema import Job, JobState, Run
from app.studio import access, audit
from app.studio.errors import StudioError
from app.studio.queue_cpu import in_claim_order

if TYPE_CHECKING:
    from app.store.schema import User

KIND_LABELS = {"train": "training", "grpo": "GRPO training", "evaluate": "checkpoint evaluation",
               "export": "export",
               "import_model": "model import", "validate_dataset": "dataset validation",
               "playground": "playground session"}


@dataclass(frozen=True)
class JobRow:
    """One job on the dashboard. ``position``: 1 for the next job its lane will claim (None
    unless queued); ``target``: the run, dataset or model it works on."""

    id: int
    kind: str
    label: str
    lane: str
    #: the lane as the page names it: "GPU slot", "CPU slot (no GPU)" or "CPU lane"
    lane_name: str
    state: str
    position: int | None
    target: str | None
    run_id: str | None
    owner: str | None
    created_at: float
    error: str | None
    #: what the state badge says (the state, or "rejected" for a dataset validation that found
    #: the dataset unusable) and its look (a state name for the ``state-*`` CSS class)
    badge: str = ""
    badge_look: str = ""
    #: the outcome a user cares about, in words (e.g. "dataset valid: 120 rows"); None: none
    outcome: str | None = None
    #: the name of the run it works on (None: no run, or the run has no name); only jobs the
    #: reader may see are listed, so it is never another member's run name
    run_name: str | None = None


def lane_of(kind: str) -> str:
    """``cpu`` for the kinds a worker's CPU lane claims, else ``gpu``."""
    return "cpu" if kind in CPU_KINDS else "gpu"


def lane_name(lane: str, gpu: bool | None) -> str:
    """``lane`` (:func:`lane_of`) as a page names it: the ``gpu`` lane is a "GPU slot", or the
    "CPU slot (no GPU)" when the live workers have no GPU (``gpu`` False:
    :func:`app.studio.worker_view.any_gpu`); ``cpu`` is the "CPU lane"."""
    if lane == "cpu":
        return "CPU lane"
    return "CPU slot (no GPU)" if gpu is False else "GPU slot"


def outcome(job: Job) -> tuple[str, str, str | None]:
    """(badge, badge look, outcome words) of ``job`` for the jobs table. A dataset validation
    succeeds as a job whether or not the dataset was usable; its row says which: ``"rejected"``
    (look ``failed``) with ``"dataset rejected: <why>"``, or ``"dataset valid: 120 rows"`` /
    ``"dataset validation: 3 rows invalid, 117 valid"`` (:func:`app.studio.validation.validate`'s
    result). Other jobs: their state, no words."""
    result = job.result or {}
    if job.kind != "validate_dataset" or job.state != JobState.SUCCEEDED:
        return job.state, job.state, None
    if result.get("status") == "error":
        return "rejected", JobState.FAILED, f"dataset rejected: {result.get('error') or '?'}"
    if result.get("skipped"):
        return job.state, job.state, f"skipped: {result['skipped']}"
    rows, invalid = result.get("rows"), result.get("invalid_rows")
    if invalid:
        return job.state, job.state, (f"dataset validation: {invalid:,} row"
                                      f"{'s' if invalid != 1 else ''} invalid, "
                                      f"{rows if rows is not None else '?'} valid")
    if rows is not None:
        return job.state, job.state, f"dataset valid: {rows:,} row{'s' if rows != 1 else ''}"
    return job.state, job.state, None


def list_jobs(engine: Engine, actor: User, recent: int = 20,
              gpu: bool | None = None) -> list[JobRow]:
    """The jobs ``actor`` may see: every queued or running one (queued in claim order, with
    its position in its lane), then the ``recent`` newest finished ones. ``gpu``: whether the
    live workers have a GPU (:func:`lane_name`)."""
    with session_scope(engine) as s:
        active = in_claim_order(s, s.exec(select(Job).where(
            Job.state.in_([JobState.QUEUED, JobState.RUNNING]))).all())
        done = list(s.exec(select(Job).where(Job.state.in_(JobState.FINAL))
                           .order_by(Job.id.desc()).limit(recent * 5)).all())
        run_ids = {j.run_id for j in active + done if j.run_id}
        runs = s.exec(select(Run).where(Run.id.in_(run_ids))).all() if run_ids else []
        run_owner = {r.id: r.owner for r in runs}
        run_name = {r.id: r.name for r in runs}
    counters = {"cpu": 0, "gpu": 0}
    rows: list[JobRow] = []
    finished: list[JobRow] = []
    for job in active + done:
        lane, position = lane_of(job.kind), None
        if job.state == JobState.QUEUED:
            counters[lane] += 1
            position = counters[lane]
        owner = run_owner.get(job.run_id, job.owner) if job.run_id else job.owner
        if not access.can_see(actor, owner):
            continue
        payload = job.payload or {}
        badge, look, words = outcome(job)
        row = JobRow(job.id, job.kind, KIND_LABELS.get(job.kind, job.kind), lane,
                     lane_name(lane, gpu), job.state,
                     position, job.run_id or payload.get("dataset_id") or payload.get("model_id"),
                     job.run_id, owner, job.created_at, job.error, badge, look, words,
                     run_name.get(job.run_id))
        (rows if job.state not in JobState.FINAL else finished).append(row)
    return rows + finished[:recent]


def cancel(engine: Engine, actor: User, job: Job, what: str, object_type: str) -> Job:
    """Ask ``job`` (already checked visible to ``actor``: :mod:`app.studio.access`) to stop: a
    queued job ends ``cancelled`` at once; a running one gets its cancel flag, which its worker
    reads at the next heartbeat and stops at its next check, removing what it had written (no
    half-written file, nothing registered as an artifact). Records ``<object_type>.cancelled``
    in the audit log. ``what`` names the job in the refusal, e.g. ``"export 12"``.

    Raises StudioError conflict when the job already ended (``{what} is already succeeded``),
    as cancelling a run's ended job does over /api."""
    if job.state in JobState.FINAL:
        raise StudioError("conflict", f"{what} is already {job.state}; only a queued or running "
                                      "job can be cancelled")
    job = queue.cancel(engine, job.id)
    audit.record(engine, actor.id, f"{object_type}.cancelled", object_type, job.id,
                 run=job.run_id)
    return job
