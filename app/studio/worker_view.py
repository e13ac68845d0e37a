"""The live workers as a user should read them (the dashboard's Workers card, ``/healthz``).

One process registers several worker rows (``app.store.workers``); on their own they read as
look-alike "workers". Each row has a *role*:

* ``supervisor``: a supervisor process's own row (``python -m worker --supervise``,
  worker/supervisor.py): it admits queued GPU jobs onto its slots and runs none itself;
* ``gpu_slot``: one GPU of a supervisor (``<id>-gpu<i>``, ``gpu_capacity_gib`` set): training,
  evaluation and playground jobs share it by memory;
* ``cpu_slot``: a supervisor's slot on a box without a GPU (``<id>-main``, device ``cpu slot …``):
  one such job at a time;
* ``cpu_lane``: the second claim loop of a process (``<id>-cpu``, device ending
  :data:`app.studio.queue_cpu.LANE_SUFFIX`): exports, model imports, dataset validations, one at
  a time, beside the slots;
* ``worker``: a plain worker process (``python -m worker``) that claims and runs jobs itself.

:func:`worker_groups` puts the rows of one process (same host and pid) together: one
:class:`WorkerGroup` per supervisor or plain worker, its slots and lane named as such.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store.db import session_scope
from app.store.schema import Job, Run, User, Worker
from app.studio import access
from app.studio.queue_cpu import LANE_SUFFIX

ROLES = ("supervisor", "gpu_slot", "cpu_slot", "cpu_lane", "worker")


@dataclass
class WorkerPart:
    """One worker row: ``id``, ``role`` (see :data:`ROLES`), ``name`` (``"GPU 0 slot"``,
    ``"CPU lane"``, …), ``what`` (plain words: what it runs), ``device``, ``job_id`` (the job
    its heartbeat last reported, None: idle or, with ``other_job``, another user's job that
    the viewer may not see: :func:`visible_groups`), ``last_seen`` (epoch seconds)."""

    id: str
    role: str
    name: str
    what: str
    device: str
    job_id: int | None
    last_seen: float
    other_job: bool = False


@dataclass
class WorkerGroup:
    """One process: ``id`` (its own row's id; ``"worker 1"``, ... for a non-admin, as the id
    names the host and pid), ``kind`` (``supervisor`` | ``worker``), ``host``, ``pid`` (None
    for a non-admin), ``what`` (plain words), ``parts`` (its own row first, then its slots by
    index, then its CPU lane) and ``last_seen`` (the newest of its rows, epoch seconds)."""

    id: str
    kind: str
    host: str | None
    pid: int | None
    what: str
    parts: list[WorkerPart] = field(default_factory=list)
    last_seen: float = 0.0

    @property
    def slots(self) -> list[WorkerPart]:
        """The GPU or CPU slots of a supervisor (empty for a plain worker)."""
        return [p for p in self.parts if p.role in ("gpu_slot", "cpu_slot")]

    @property
    def lane(self) -> WorkerPart | None:
        """Its CPU lane, if it runs one."""
        return next((p for p in self.parts if p.role == "cpu_lane"), None)


def _is_slot(w: Worker) -> bool:
    return w.gpu_capacity_gib is not None or w.device.startswith("cpu slot")


def role_of(w: Worker, slot_processes: set[tuple[str, int]]) -> str:
    """The role of row ``w`` (see the module docstring); ``slot_processes`` are the (host, pid)
    of the processes that registered a slot (their other, non-lane row is their supervisor)."""
    if w.gpu_capacity_gib is not None:
        return "gpu_slot"
    if w.device.startswith("cpu slot"):
        return "cpu_slot"
    if w.device.endswith(LANE_SUFFIX):
        return "cpu_lane"
    return "supervisor" if (w.host, w.pid) in slot_processes else "worker"


def _part(w: Worker, role: str) -> WorkerPart:
    if role == "gpu_slot":
        name = f"GPU {w.gpu_index} slot" if w.gpu_index is not None else "GPU slot"
        total = f" of {w.gpu_total_gib:.1f}" if w.gpu_total_gib else ""
        what = (f"{w.gpu_capacity_gib:.1f}{total} GiB admissible: training, evaluation and "
                "playground jobs share it by memory")
    elif role == "cpu_slot":
        name, what = "CPU slot (no GPU)", "one training, evaluation or playground job at a time"
    elif role == "cpu_lane":
        name, what = ("CPU lane", "exports, model imports and dataset validations, one at a "
                      "time, beside the slots")
    elif role == "supervisor":
        name, what = "supervisor", "admits queued jobs onto its slots; runs none itself"
    else:
        name, what = "main loop", "claims queued jobs and runs them one at a time"
    device = w.device[:-len(LANE_SUFFIX)].strip() if role == "cpu_lane" else w.device
    return WorkerPart(w.id, role, name, what, device, w.current_job_id, w.last_seen)


def worker_groups(rows: list[Worker]) -> list[WorkerGroup]:
    """The live worker ``rows`` grouped by process (see the module docstring), ordered by host
    and id."""
    slot_processes = {(w.host, w.pid) for w in rows if _is_slot(w)}
    by_process: dict[tuple[str, int], list[WorkerPart]] = {}
    for w in rows:
        by_process.setdefault((w.host, w.pid), []).append(_part(w, role_of(w, slot_processes)))
    order = {r: i for i, r in enumerate(("supervisor", "worker", "gpu_slot", "cpu_slot",
                                         "cpu_lane"))}
    groups = []
    for (host, pid), parts in by_process.items():
        parts.sort(key=lambda p: (order[p.role], p.id))
        head = parts[0]
        kind = "supervisor" if (host, pid) in slot_processes else "worker"
        n = sum(1 for p in parts if p.role == "gpu_slot")
        if kind == "supervisor":
            slots = (f"{n} GPU slot{'s' if n != 1 else ''}" if n else "a CPU slot (no GPU)")
            what = f"supervisor with {slots}" + (" and a CPU lane" if any(
                p.role == "cpu_lane" for p in parts) else "")
        else:
            what = "plain worker: runs the jobs it claims itself" + (
                ", with a CPU lane" if any(p.role == "cpu_lane" for p in parts) else "")
        groups.append(WorkerGroup(head.id if head.role in ("supervisor", "worker") else
                                  head.id.rsplit("-", 1)[0], kind, host, pid, what, parts,
                                  max(p.last_seen for p in parts)))
    groups.sort(key=lambda g: (g.host, g.id))
    return groups


def any_gpu(rows: list[Worker]) -> bool | None:
    """Whether the live worker ``rows`` have a GPU slot (a job of a GPU kind runs on a GPU);
    False: only CPU slots (a CPU-only box); None: no live worker, nothing tells."""
    if not rows:
        return None
    return any(w.gpu_capacity_gib is not None for w in rows)


def visible_groups(engine: Engine, actor: User | None, rows: list[Worker]) -> list[WorkerGroup]:
    """:func:`worker_groups` as ``actor`` may see them (the dashboard's Workers card): an admin
    sees everything; anyone else no host, pid or process id (``id`` becomes ``"worker 1"``,
    ``"worker 2"``, ...; /healthz shows them to admins only) and, for a part running a job
    ``actor`` does not own (:func:`app.studio.access.can_see`; a run's job is its run owner's),
    ``job_id`` None with ``other_job`` True ("another user's job", as on the Queue page)."""
    groups = worker_groups(rows)
    if access.is_admin(actor):
        return groups
    ids = {p.job_id for g in groups for p in g.parts if p.job_id is not None}
    owner: dict[int, str | None] = {}
    if ids:
        with session_scope(engine) as s:
            jobs = s.exec(select(Job).where(Job.id.in_(ids))).all()
            runs = {j.run_id for j in jobs if j.run_id}
            run_owner = {r.id: r.owner for r in s.exec(select(Run).where(Run.id.in_(runs)))} \
                if runs else {}
            owner = {j.id: run_owner.get(j.run_id, j.owner) if j.run_id else j.owner
                     for j in jobs}

    def part(p: WorkerPart, label: str) -> WorkerPart:
        p = replace(p, id=f"{label} {p.role}")  # a row's id names the host and pid too
        if p.job_id is None or access.can_see(actor, owner.get(p.job_id)):
            return p
        return replace(p, job_id=None, other_job=True)

    return [replace(g, id=f"worker {i}", host=None, pid=None,
                    parts=[part(p, f"worker {i}") for p in g.parts])
            for i, g in enumerate(groups, 1)]


def health(rows: list[Worker]) -> dict[str, Any]:
    """The ``/healthz`` worker figures of the live worker ``rows``, from one
    :func:`worker_groups` (a probe's cost): ``live_workers``, the worker processes
    (supervisors and plain workers, not their slot and lane rows), their ``gpu_slots``,
    ``cpu_slots`` (a supervisor's slot on a box without a GPU) and ``cpu_lanes``; and
    ``workers`` (for admins), in ``rows``' order: each row's ``id``, ``host``, ``pid``,
    ``device``, ``last_seen``, ``current_job_id`` and, added, its ``role`` and ``group`` (the id
    of the process it belongs to)."""
    groups = worker_groups(rows)
    of = {p.id: (p.role, g.id) for g in groups for p in g.parts}
    roles = [p.role for g in groups for p in g.parts]
    return {"live_workers": len(groups), "gpu_slots": roles.count("gpu_slot"),
            "cpu_slots": roles.count("cpu_slot"), "cpu_lanes": roles.count("cpu_lane"),
            "workers": [{"id": w.id, "host": w.host, "pid": w.pid, "device": w.device,
                         "last_seen": w.last_seen, "current_job_id": w.current_job_id,
                         "role": of[w.id][0], "group": of[w.id][1]} for w in rows]}
