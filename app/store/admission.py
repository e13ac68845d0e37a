"""GPU admission: which queued GPU job a GPU slot takes next, and why every other one waits.

A *slot* is one GPU of one supervisor (worker/supervisor.py), registered as a worker row with its
``gpu_capacity_gib`` (total memory less ``settings.gpu_reserve_gib``). A job *needs*
``estimate_gib x (1 + gpu_admit_margin) + CUDA_CONTEXT_GIB`` GiB (a job with no estimate needs the
whole slot: it runs alone). It is admitted onto a slot when

* its owner's jobs are not held (:func:`hold_reason`: the account is disabled, or its "Jobs at
  once" is 0; an admin's way to pause a user: held jobs wait, running ones go on) and the owner
  is within their quotas (jobs running at once, GiB admitted at once, GPU-hours in the last
  24 h; ``users.quota_*``, None = no limit), and
* its need fits beside the ``admitted_gib`` of the jobs already running on that slot;
* a data-parallel run (its spec's ``num_gpus`` N > 1) needs N slots of one host at once: the
  offered slot and the N-1 others of its host with the most free memory, each with room for
  its need (the estimate is per GPU); its ``gpu_slot`` lists them, comma-separated
  (:func:`slot_ids`), ``gpu_index`` is the first's.

**Admission order** (the order waiting jobs are offered to a slot; the first admissible one is
taken, so a small job may start beside a running one while a big one waits for room):

1. jobs an admin moved to the front (newest move first);
2. then fair share: the next job comes from the owner whose weighted recent GPU time
   (GPU-seconds in the last ``fair_share_hours`` / ``users.share_weight``) is least; a running job
   counts at least :data:`START_CHARGE_SECONDS`, so two users who both just started alternate;
   each pick charges its owner the same, so the order interleaves users;
3. within one owner: priority (higher first), then age.

Everything here reads; :func:`app.store.queue.admit` calls :func:`snapshot` and :func:`pick` in
its claim transaction (under ``BEGIN IMMEDIATE`` / a Postgres advisory lock) and writes the
reservation. GPU time = ((finished or now) - started) x the job's GPUs, per job on a GPU.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from sqlalchemy import or_
from sqlmodel import Session, select

from app.store.schema import Job, JobState, Run, User, Worker
from app.studio.estimate import CUDA_CONTEXT_GIB

#: GPU-seconds a running job counts for fair share however young it is (10 minutes).
START_CHARGE_SECONDS = 600.0
#: The GPU-hours quota looks back this many seconds (24 h).
DAY_SECONDS = 86400.0


@dataclass(frozen=True)
class Slot:
    """One GPU a supervisor owns: ``id`` is its worker row id (``<supervisor>-gpu<i>``);
    ``capacity_gib`` None is the CPU of a box without a GPU (one job at a time)."""

    id: str
    host: str
    index: int | None
    capacity_gib: float | None
    total_gib: float | None = None


@dataclass
class Owner:
    """A user's standing at admission time (GPU-seconds, GiB)."""

    id: str | None
    name: str
    quota_jobs: int | None = None
    quota_gib: float | None = None
    quota_gpu_hours: float | None = None
    weight: float = 1.0
    #: the account is disabled: its waiting jobs are held (:func:`hold_reason`)
    disabled: bool = False
    running: int = 0
    held_gib: float = 0.0
    day_seconds: float = 0.0
    recent_seconds: float = 0.0


@dataclass
class Snapshot:
    """What admission looks at: waiting jobs, running jobs per slot, owners, the time."""

    now: float
    margin: float
    waiting: list[Job]
    running: list[Job]
    owners: dict[str | None, Owner]
    slots: list[Slot] = field(default_factory=list)
    #: waiting job id -> GPUs it needs at once (its run spec's ``num_gpus``; absent = 1)
    gpus: dict[int, int] = field(default_factory=dict)

    def held(self, slot_id: str) -> tuple[float, int]:
        """(GiB admitted, jobs) running on slot ``slot_id`` (a data-parallel job holds its
        ``admitted_gib`` on each of its slots)."""
        jobs = [j for j in self.running if slot_id in slot_ids(j)]
        return sum(j.admitted_gib or 0.0 for j in jobs), len(jobs)

    def free(self, slot: Slot) -> float | None:
        """GiB still admissible on ``slot`` (None: a CPU slot)."""
        if slot.capacity_gib is None:
            return None
        return slot.capacity_gib - self.held(slot.id)[0]


def slot_ids(job: Job) -> list[str]:
    """The slot ids a job holds: ``gpu_slot`` is one id, or several comma-separated for a
    data-parallel job (``num_gpus`` > 1); [] when it holds none."""
    return [p for p in (job.gpu_slot or "").split(",") if p]


def need_gib(estimate_gib: float | None, margin: float, capacity_gib: float | None) -> float | None:
    """GiB a job is admitted with: its allocator estimate x (1 + margin) + the CUDA context;
    without an estimate the whole ``capacity_gib`` (it runs alone)."""
    if estimate_gib is None:
        return capacity_gib
    return round(estimate_gib * (1 + margin) + CUDA_CONTEXT_GIB, 4)


def gpu_seconds(job: Job, start: float, end: float) -> float:
    """GPU-seconds of ``job`` inside ``[start, end]``: its seconds there x the GPUs it held (0
    unless it ran on a GPU)."""
    if job.gpu_index is None or job.started_at is None:
        return 0.0
    stop = job.finished_at if job.finished_at is not None else end
    return max(0.0, min(stop, end) - max(job.started_at, start)) * max(1, len(slot_ids(job)))


def snapshot(s: Session, now: float, kinds: Collection[str], margin: float,
             fair_share_hours: float) -> Snapshot:
    """Read what admission needs in session ``s``: the queued jobs of ``kinds`` (not cancelled),
    the running jobs holding a slot, and each owner's quotas and GPU time (GPU-seconds in the
    last day and in the last ``fair_share_hours`` hours)."""
    waiting = list(s.exec(select(Job).where(Job.state == JobState.QUEUED, Job.kind.in_(kinds),
                                            Job.cancel_requested == False)  # noqa: E712
                          .order_by(Job.id)).all())
    running = list(s.exec(select(Job).where(Job.state == JobState.RUNNING,
                                            Job.gpu_slot.is_not(None))).all())
    window = max(DAY_SECONDS, fair_share_hours * 3600.0)
    used = list(s.exec(select(Job).where(Job.gpu_index.is_not(None), Job.started_at.is_not(None),
                                         or_(Job.finished_at.is_(None),
                                             Job.finished_at >= now - window))).all())
    ids = {j.owner for j in waiting + running + used}
    users = {u.id: u for u in s.exec(select(User).where(User.id.in_([i for i in ids if i])))}
    owners: dict[str | None, Owner] = {}
    for oid in ids:
        u = users.get(oid)
        owners[oid] = (Owner(oid, u.name, u.quota_jobs, u.quota_gib, u.quota_gpu_hours,
                             u.share_weight or 1.0, bool(u.disabled))
                       if u else Owner(oid, oid or "nobody"))
    for j in running:
        owners[j.owner].running += 1
        owners[j.owner].held_gib += j.admitted_gib or 0.0
    fair_start = now - fair_share_hours * 3600.0
    for j in used:
        o = owners[j.owner]
        o.day_seconds += gpu_seconds(j, now - DAY_SECONDS, now)
        sec = gpu_seconds(j, fair_start, now)
        if j.state == JobState.RUNNING:
            sec = max(sec, START_CHARGE_SECONDS)
        o.recent_seconds += sec
    run_ids = [j.run_id for j in waiting if j.run_id]
    gpus = {}
    if run_ids:
        specs = dict(s.exec(select(Run.id, Run.spec).where(Run.id.in_(run_ids))).all())
        for j in waiting:
            n = (specs.get(j.run_id) or {}).get("num_gpus", 1) if j.kind in ("train", "grpo") \
                else 1
            if isinstance(n, int) and n > 1:
                gpus[j.id] = n
    return Snapshot(now, margin, waiting, running, owners, gpus=gpus)


def order(snap: Snapshot) -> list[Job]:
    """The waiting jobs in admission order (see the module docstring)."""
    front = sorted((j for j in snap.waiting if j.front_at is not None),
                   key=lambda j: (-j.front_at, j.id))
    queues: dict[str | None, list[Job]] = {}
    for j in sorted((j for j in snap.waiting if j.front_at is None),
                    key=lambda j: (-j.priority, j.id)):
        queues.setdefault(j.owner, []).append(j)
    charge = {o: snap.owners[o].recent_seconds for o in queues}
    out = list(front)
    while queues:
        oid = min(queues, key=lambda o: (charge[o] / max(snap.owners[o].weight, 1e-6),
                                         queues[o][0].id))
        out.append(queues[oid].pop(0))
        charge[oid] += START_CHARGE_SECONDS
        if not queues[oid]:
            del queues[oid]
    return out


def gib(x: float) -> str:
    """``x`` GiB in short plain digits: ``"0.6"``, ``"0.55"``, ``"22"`` (2 decimals at most),
    for figures the studio computes (a job's need, memory held)."""
    return f"{round(x, 2):g}"


def quota_text(x: float) -> str:
    """A quota as the admin set it, every digit kept (``"0.001"``, ``"9.25"``, ``"2"``): the
    admission compares the stored value, so a message must not round it (0.001 is not "0")."""
    return f"{x:.15g}"


def over_gib_quota(quota_gib: float | None, need: float | None) -> bool:
    """Whether a job admitted with ``need`` GiB (over all its GPUs) is more than a GPU memory
    quota of ``quota_gib`` GiB at once allows even alone: it can never start under that quota.
    False without a quota or a known need."""
    return quota_gib is not None and need is not None and need > quota_gib + 1e-9


#: Why a job is held, as a member reads another user's job (an anonymous slot): no name.
HELD_ANONYMOUS = {"disabled": "held: its owner's account is disabled",
                  "paused": "held: its owner's Jobs at once is 0"}


def hold_kind(owner: Owner | User) -> str | None:
    """Whether no job of ``owner`` (an :class:`Owner`, or the User row: the same two fields)
    may start now, whatever is free: ``"disabled"`` (an admin disabled the account),
    ``"paused"`` (its "Jobs at once" quota is 0), else None."""
    if owner.disabled:
        return "disabled"
    if owner.quota_jobs is not None and owner.quota_jobs <= 0:
        return "paused"
    return None


def hold_reason(owner: Owner, whose: str | None = None) -> str | None:
    """Why ``owner``'s waiting jobs are held (none of them is admitted, however much is free),
    or None: the account is disabled, or its "Jobs at once" quota (the Admin page's name) is 0.
    ``whose``: None when the owner reads, else the owner's name (an admin reading)."""
    kind = hold_kind(owner)
    if kind == "disabled":
        name = "your" if whose is None else f"{whose}'s"
        return f"held: {name} account is disabled; enabling it again releases the job"
    if kind == "paused":
        if whose is None:
            return "held: Jobs at once is 0 for you; ask an admin"
        return (f"held: Jobs at once is 0 for {whose}; raising it on the Admin page releases "
                "the job")
    return None


def quota_reason(owner: Owner, need: float | None, whose: str | None = None) -> str | None:
    """Why ``owner``'s next job of ``need`` GiB is held (:func:`hold_reason`) or over quota, or
    None when it is within.

    ``whose``: None when the reader is the owner ("your 1 running job reaches your limit of 1
    at once"), else the owner's name, for an admin reading another user's job ("bob's 2
    running jobs reach bob's limit of 2 at once"). A job whose need alone is more than the
    GPU memory quota (:func:`over_gib_quota`) says it can never start under that quota."""
    held = hold_reason(owner, whose)
    if held is not None:
        return held
    mine = "your" if whose is None else f"{whose}'s"
    if over_gib_quota(owner.quota_gib, need):
        return (f"over quota, can never start under {mine} current quota: this job needs "
                f"{gib(need)} GiB of GPU memory at once, more than {mine} limit of "
                f"{quota_text(owner.quota_gib)} GiB even with no other job running; an admin "
                "can raise the limit (GPU memory at once) on the Admin page")
    one = owner.running == 1
    jobs = f"{mine} {owner.running} running job{'' if one else 's'}"
    if owner.quota_jobs is not None and owner.running >= owner.quota_jobs:
        return (f"over quota: {jobs} {'reaches' if one else 'reach'} {mine} limit of "
                f"{owner.quota_jobs} at once")
    if owner.quota_gib is not None and owner.held_gib + (need or 0.0) > owner.quota_gib + 1e-9:
        return (f"over quota: {jobs} {'holds' if one else 'hold'} {owner.held_gib:.1f} GiB of "
                f"{mine} {quota_text(owner.quota_gib)} GiB; this one needs {need or 0.0:.1f} GiB")
    if owner.quota_gpu_hours is not None and owner.day_seconds / 3600 >= owner.quota_gpu_hours:
        who = "you" if whose is None else whose
        return (f"over quota: {who} used {owner.day_seconds / 3600:.2f} GPU-hours in the last "
                f"24 h (limit {owner.quota_gpu_hours:g})")
    return None


def fits(snap: Snapshot, slot: Slot, need: float | None) -> bool:
    """Whether a job of ``need`` GiB fits beside the jobs running on ``slot`` now (a CPU slot
    takes one job at a time)."""
    if slot.capacity_gib is None:
        return snap.held(slot.id)[1] == 0
    return need is not None and need <= snap.free(slot) + 1e-9


def group_for(snap: Snapshot, slot: Slot, peers: Collection[Slot], n: int,
              need: float | None) -> list[Slot] | None:
    """``slot`` and the ``n - 1`` other GPU slots of its host among ``peers`` with the most free
    memory, when each has room for ``need`` GiB now; None when there are not enough (a CPU slot
    never joins a group)."""
    if n <= 1:
        return [slot] if fits(snap, slot, need) else None
    if slot.capacity_gib is None or not fits(snap, slot, need):
        return None
    others = [p for p in peers if p.id != slot.id and p.host == slot.host
              and p.capacity_gib is not None and fits(snap, p, need)]
    if len(others) < n - 1:
        return None
    others.sort(key=lambda p: (-(snap.free(p) or 0.0), p.id))
    return [slot, *others[:n - 1]]


def admits(snap: Snapshot, job: Job, slot: Slot, peers: Collection[Slot] = ()
           ) -> tuple[float | None, list[Slot]] | None:
    """``(GiB per GPU, slots)`` when ``slot`` (with ``peers`` for a data-parallel job) admits
    ``job`` now: its owner within quota and its need fitting; None when it does not."""
    n = snap.gpus.get(job.id, 1)
    need = need_gib(job.estimate_gib, snap.margin, slot.capacity_gib)
    total = None if need is None else need * n
    if quota_reason(snap.owners[job.owner], total) is not None:
        return None
    group = group_for(snap, slot, peers, n, need)
    return None if group is None else (need, group)


def pick(snap: Snapshot, slot: Slot, peers: Collection[Slot] = ()
         ) -> tuple[Job, float | None, list[Slot]] | None:
    """The first job in admission order whose owner is within quota and that fits on ``slot``
    now (a data-parallel job: on ``slot`` and enough of ``peers``, see :func:`group_for`), with
    the GiB it is admitted with on each GPU and its slots; None when none. A job's quota counts
    its memory on every GPU it takes."""
    for job in order(snap):
        got = admits(snap, job, slot, peers)
        if got is not None:
            return job, got[0], got[1]
    return None


def without(snap: Snapshot, holder: Job) -> Snapshot:
    """``snap`` as it would be once the running job ``holder`` ended: its memory freed on its
    slots, its owner's running jobs and admitted GiB one job less."""
    owners = {k: replace(v) for k, v in snap.owners.items()}
    if holder.owner in owners:
        o = owners[holder.owner]
        o.running = max(0, o.running - 1)
        o.held_gib = max(0.0, o.held_gib - (holder.admitted_gib or 0.0))
    return Snapshot(snap.now, snap.margin, [j for j in snap.waiting if j.id != holder.id],
                    [j for j in snap.running if j.id != holder.id], owners, snap.slots,
                    snap.gpus)


def waits_for(snap: Snapshot, holder: Job, slots: Collection[Slot]) -> Job | None:
    """The first waiting job, in admission order, that no slot of ``slots`` admits now but one
    of the slots the running job ``holder`` holds would admit once ``holder`` ended: a job
    ``holder`` keeps waiting (an idle playground session then gives its slot up). None when
    no waiting job needs what ``holder`` holds (the jobs admitted now start anyway)."""
    mine = [sl for sl in slots if sl.id in slot_ids(holder)]
    if not mine:
        return None
    freed = without(snap, holder)
    for job in order(snap):
        if job.id == holder.id or any(admits(snap, job, sl, slots) for sl in slots):
            continue
        if any(admits(freed, job, sl, slots) for sl in mine):
            return job
    return None


def slots_of(workers: list[Worker]) -> list[Slot]:
    """The GPU slots among worker rows (those a supervisor registered with a capacity or as
    its CPU slot: ``gpu_index`` set, or ``device`` starting with ``slot``)."""
    out = []
    for w in workers:
        if w.gpu_capacity_gib is not None:
            out.append(Slot(w.id, w.host, w.gpu_index, w.gpu_capacity_gib, w.gpu_total_gib))
        elif w.device.startswith("cpu slot"):
            out.append(Slot(w.id, w.host, None, None, None))
    return out
