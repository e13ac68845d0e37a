"""The queue as a user sees it: every job kind with its state, lane and place in the queue.

A worker process runs two lanes (see worker/loop.py): ``gpu`` (train, grpo) and ``cpu``
(exports, model imports, dataset validation, :data:`app.store.queue.CPU_KINDS`), so a queued job's
position counts only the jobs ahead of it in its own lane, in claim order
(:func:`app.studio.queue_cpu.in_claim_order`: dataset validations first, then priority, then
age; the CPU lane takes turns by owner), across
every user; the list shows the caller's own jobs (an admin's: everyone's), the newest
:data:`DASHBOARD_JOBS` of them, with counts (:func:`count_jobs`) for the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import case, func, or_
from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store import queue, repo
from app.store.db import session_scope
from app.store.queue import CPU_KINDS, KIND_RANK, OTHER_RANK
from app.store.schema import Dataset, Job, JobState, Run
from app.studio import access, audit
from app.studio.datasets import shown_name
from app.studio.errors import StudioError
from app.studio.queue_cpu import in_claim_order

if TYPE_CHECKING:
    from app.store.schema import User

KIND_LABELS = {"train": "training", "grpo": "GRPO training", "evaluate": "checkpoint evaluation",
               "export": "export",
               "import_model": "model import", "validate_dataset": "dataset validation",
               "playground": "playground session"}

#: Jobs the dashboard lists: the newest ones its reader may see (the queue page has every
#: running and waiting job), so its 5 s poll reads a bounded number of rows.
DASHBOARD_JOBS = 20
#: Queued jobs read, in claim order, to number the listed queued jobs' positions; a job further
#: back than this shows no position.
POSITION_SCAN = 500


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
    #: a dataset validation's dataset: its file name ("x.json (deleted)" once deleted: no page
    #: to link to; None when even its row is gone) and whether its page exists
    dataset_name: str | None = None
    dataset_page: bool = False


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


def _visible(actor: User):
    """SQL condition for the jobs ``actor`` may see (:func:`app.studio.access.can_see`; a run's
    job is its run owner's), or None for an admin (every job)."""
    if access.is_admin(actor):
        return None
    mine = select(Run.id).where(Run.owner == actor.id)
    return or_(Job.owner == actor.id, Job.run_id.in_(mine))


def visible_jobs(engine: Engine, actor: User, kind: str, limit: int) -> list[Job]:
    """The ``limit`` newest jobs of ``kind`` that ``actor`` may see, newest first: exactly
    those :func:`app.studio.access.job` answers ``actor`` (a run's job is its run owner's;
    an admin sees every user's, as every list does)."""
    where = _visible(actor)
    with session_scope(engine) as s:
        q = select(Job).where(Job.kind == kind).order_by(Job.id.desc()).limit(limit)
        jobs = s.exec(q if where is None else q.where(where)).all()
        run_ids = {j.run_id for j in jobs if j.run_id}
        owners = dict(s.exec(select(Run.id, Run.owner).where(Run.id.in_(run_ids))).all()) \
            if run_ids else {}
    return [j for j in jobs if access.can_see(actor, owners.get(j.run_id, j.owner)
                                              if j.run_id else j.owner)]


def _positions(s) -> dict[int, int]:
    """job id -> place in its lane's claim order (1 = claimed next), for the first
    :data:`POSITION_SCAN` queued jobs of every user."""
    rank = case(KIND_RANK, value=Job.kind, else_=OTHER_RANK)
    queued = s.exec(select(Job).where(Job.state == JobState.QUEUED)
                    .order_by(rank, Job.priority.desc(), Job.id).limit(POSITION_SCAN)).all()
    counters = {"cpu": 0, "gpu": 0}
    out = {}
    for job in in_claim_order(s, list(queued)):
        counters[lane_of(job.kind)] += 1
        out[job.id] = counters[lane_of(job.kind)]
    return out


def list_jobs(engine: Engine, actor: User, limit: int = DASHBOARD_JOBS,
              gpu: bool | None = None) -> list[JobRow]:
    """The ``limit`` newest jobs ``actor`` may see (an admin: every user's), newest first; a
    queued one has its position in its lane (:func:`_positions`, across every user). Two
    bounded queries (three when one is queued), whatever the number of jobs. ``gpu``: whether
    the live workers have a GPU (:func:`lane_name`)."""
    where = _visible(actor)
    with session_scope(engine) as s:
        q = select(Job).order_by(Job.id.desc()).limit(limit)
        jobs = s.exec(q if where is None else q.where(where)).all()
        run_ids = {j.run_id for j in jobs if j.run_id}
        runs = s.exec(select(Run).where(Run.id.in_(run_ids))).all() if run_ids else []
        positions = _positions(s) if any(j.state == JobState.QUEUED for j in jobs) else {}
        ds_ids = {(j.payload or {}).get("dataset_id") for j in jobs
                  if j.kind == "validate_dataset"} - {None}
        validated = {d.id: d for d in s.exec(select(Dataset).where(Dataset.id.in_(ds_ids)))} \
            if ds_ids else {}
    run_owner = {r.id: r.owner for r in runs}
    run_name = {r.id: r.name for r in runs}
    rows: list[JobRow] = []
    for job in jobs:
        lane = lane_of(job.kind)
        owner = run_owner.get(job.run_id, job.owner) if job.run_id else job.owner
        if not access.can_see(actor, owner):
            continue
        payload = job.payload or {}
        badge, look, words = outcome(job)
        ds = validated.get(payload.get("dataset_id"))
        rows.append(JobRow(job.id, job.kind, KIND_LABELS.get(job.kind, job.kind), lane,
                           lane_name(lane, gpu), job.state, positions.get(job.id),
                           job.run_id or payload.get("dataset_id") or payload.get("model_id"),
                           job.run_id, owner, job.created_at, job.error, badge, look, words,
                           run_name.get(job.run_id),
                           shown_name(ds) if ds is not None else None,
                           ds is not None and ds.status != repo.DELETED))
    return rows


@dataclass(frozen=True)
class JobCounts:
    """How many jobs a reader may see: ``total`` (any state), ``running`` and ``queued``."""

    total: int
    running: int
    queued: int


def count_jobs(engine: Engine, actor: User) -> JobCounts:
    """The number of jobs ``actor`` may see (an admin: every user's), by state: one grouped
    count, so the dashboard can say what :func:`list_jobs` leaves out."""
    where = _visible(actor)
    q = select(Job.state, func.count()).group_by(Job.state)
    with session_scope(engine) as s:
        by_state = dict(s.exec(q if where is None else q.where(where)).all())
    return JobCounts(sum(by_state.values()), by_state.get(JobState.RUNNING, 0),
                     by_state.get(JobState.QUEUED, 0))


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
