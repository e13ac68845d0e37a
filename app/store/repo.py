"""Create/read helpers for datasets, models, runs and artifacts, shared by web and worker.

Everything that writes several rows together (a run and its job) does it in one transaction.
Lookups raise :class:`NotFound` naming what was missing.
"""
from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import or_, select

from app.store import events
from app.store.db import session_scope
from app.store.schema import Artifact, Dataset, Job, JobEvent, JobState, Model, Run
from app.store.specs import TrainSpec


class NotFound(LookupError):
    """A dataset, model, run or artifact id that does not exist (message names it)."""


# ---- datasets ---------------------------------------------------------------------------
def add_dataset(engine: Engine, ds: Dataset) -> Dataset:
    """Insert a dataset row."""
    with session_scope(engine, immediate=True) as s:
        s.add(ds)
        return ds


#: ``Dataset.status`` of a deleted dataset whose row stays as the record of the runs that used
#: it (:func:`delete_dataset`): its file is gone and only ``deleted=True`` readers see it.
DELETED = "deleted"


def get_dataset(engine: Engine, dataset_id: str, deleted: bool = False) -> Dataset:
    """Load a dataset by id; a deleted one (:data:`DELETED`) only with ``deleted`` (to name
    it on a run that used it). Raises NotFound."""
    with session_scope(engine) as s:
        ds = s.get(Dataset, dataset_id)
        if ds is None or (ds.status == DELETED and not deleted):
            raise NotFound(f"no dataset with id {dataset_id!r}")
        return ds


def list_datasets(engine: Engine, limit: int = 200, owner: str | None = None,
                  deleted: bool = False) -> list[Dataset]:
    """Datasets, newest first; only those of user id ``owner`` when it is given; deleted ones
    (:data:`DELETED`) only with ``deleted``."""
    with session_scope(engine) as s:
        q = select(Dataset).order_by(Dataset.created_at.desc())
        if owner is not None:
            q = q.where(Dataset.owner == owner)
        if not deleted:
            q = q.where(Dataset.status != DELETED)
        return list(s.exec(q.limit(limit)).all())


def update_dataset(engine: Engine, dataset_id: str, **fields: Any) -> Dataset:
    """Set columns of a dataset row (not of a deleted one: a validation that ends after the
    delete does not bring it back). Raises NotFound."""
    with session_scope(engine, immediate=True) as s:
        ds = s.get(Dataset, dataset_id)
        if ds is None or ds.status == DELETED:
            raise NotFound(f"no dataset with id {dataset_id!r}")
        for k, v in fields.items():
            setattr(ds, k, v)
        s.add(ds)
        return ds


def _lock_live_datasets(s, dataset_ids: list[str | None]) -> None:
    """In a write transaction: lock the rows of ``dataset_ids`` (None skipped) against a
    concurrent :func:`delete_dataset` (Postgres ``FOR UPDATE``; SQLite's write lock already
    serialises); raises NotFound for one that does not exist or was deleted."""
    for ds_id in filter(None, dataset_ids):
        ds = s.exec(select(Dataset).where(Dataset.id == ds_id).with_for_update()).first()
        if ds is None or ds.status == DELETED:
            raise NotFound(f"no dataset with id {ds_id!r}")


def _uses(run: Run, dataset_id: str) -> bool:
    return run.dataset_id == dataset_id or (run.spec or {}).get("validation_file") == dataset_id


#: Job kinds that read their run's dataset files: training and a checkpoint's evaluation (which
#: rebuilds the held-out set). An export or a playground session of the run does not need them.
READS_DATA = ("train", "grpo", "evaluate")


def _active_uses(s, dataset_id: str) -> list[tuple[Run, int, str, str]]:
    return [(run, job_id, kind, state) for run, job_id, kind, state in s.exec(
        select(Run, Job.id, Job.kind, Job.state).join(Job, Job.run_id == Run.id)
        .where(Job.state.in_(ACTIVE), Job.kind.in_(READS_DATA)).order_by(Job.id)).all()
        if _uses(run, dataset_id)]


def active_uses(engine: Engine, dataset_id: str) -> list[tuple[Run, int, str, str]]:
    """The queued or running jobs that read dataset ``dataset_id`` (:data:`READS_DATA` kinds of
    runs whose training dataset or ``validation_file`` it is), oldest first: ``(run, job id,
    job kind, state)``."""
    with session_scope(engine) as s:
        return _active_uses(s, dataset_id)


def delete_dataset(engine: Engine, dataset_id: str) -> tuple[Dataset, bool]:
    """Delete a dataset (not its file): ``(its row as it was, kept)``. A dataset that runs
    trained or evaluated on keeps its row as their record, marked :data:`DELETED` (``kept``
    True; readers see it only with ``deleted=True``); one no run names is removed.

    Raises NotFound (unknown or already deleted); InUse when a queued or running job of a run
    uses it (:func:`active_uses`; ``run_id`` and ``kind`` of the first, ``busy`` = every such
    ``(job id, kind, state)``).
    """
    with session_scope(engine, immediate=True) as s:
        ds = s.exec(select(Dataset).where(Dataset.id == dataset_id).with_for_update()).first()
        if ds is None or ds.status == DELETED:
            raise NotFound(f"no dataset with id {dataset_id!r}")
        busy = _active_uses(s, dataset_id)
        if busy:
            run, _, kind, state = busy[0]
            raise InUse(f"dataset {dataset_id!r} is used by fine-tuning job {run.id!r}, whose "
                        f"{kind} job is {state}", run.id, kind,
                        [(job_id, k, st) for _, job_id, k, st in busy])
        before = Dataset.model_validate(ds.model_dump())
        named = s.exec(select(Run.id).where(Run.dataset_id == dataset_id).limit(1)).first() \
            is not None or any(_uses(r, dataset_id) for r in s.exec(select(Run)).all())
        if named:
            ds.status, ds.report = DELETED, None
            s.add(ds)
        else:
            s.delete(ds)
        return before, named


#: Job states in which a job uses its run's files and inputs.
ACTIVE = (JobState.QUEUED, JobState.RUNNING)


class InUse(ValueError):
    """A row cannot be deleted because another row references it (message names it;
    ``run_id``: the run that holds it, when one does; ``kind``: the busy job's kind;
    ``busy``: every busy job as ``(id, kind, state)``, oldest first, when several may be)."""

    def __init__(self, message: str, run_id: str | None = None, kind: str | None = None,
                 busy: list[tuple[int, str, str]] | None = None):
        super().__init__(message)
        self.run_id, self.kind, self.busy = run_id, kind, busy or []


# ---- models -----------------------------------------------------------------------------
def add_model(engine: Engine, model: Model, import_job: bool = True) -> Model:
    """Register a model and (by default) queue the ``import_model`` job that makes it ready
    (owned by the model's owner)."""
    with session_scope(engine, immediate=True) as s:
        s.add(model)
        s.flush()
        if import_job:
            job = Job(kind="import_model", payload={"spec_version": 1, "model_id": model.id},
                      priority=10, owner=model.owner)
            s.add(job)
            s.flush()
            events.append(s, job.id, "state", {"state": JobState.QUEUED})
        return model


def models_named(engine: Engine, id_or_name: str) -> list[Model]:
    """Every model whose id or name is ``id_or_name`` (names are unique per owner, so several
    users may each have one of that name), oldest first."""
    with session_scope(engine) as s:
        q = (select(Model).where(or_(Model.id == id_or_name, Model.name == id_or_name))
             .order_by(Model.created_at))
        return list(s.exec(q).all())


def get_model(engine: Engine, id_or_name: str) -> Model:
    """Load a model by id or by name (e.g. ``stories260K``). Raises NotFound."""
    with session_scope(engine) as s:
        m = s.exec(select(Model).where(or_(Model.id == id_or_name, Model.name == id_or_name))).first()
        if m is None:
            raise NotFound(f"no model {id_or_name!r} is registered")
        return m


def list_models(engine: Engine, owner: str | None = None) -> list[Model]:
    """Registered models, oldest first; when user id ``owner`` is given, only that user's models
    and the shared ones."""
    with session_scope(engine) as s:
        q = select(Model).order_by(Model.created_at)
        if owner is not None:
            q = q.where(or_(Model.owner == owner, Model.shared == True))  # noqa: E712 - SQL
        return list(s.exec(q).all())


def delete_model(engine: Engine, model_id: str) -> Model:
    """Delete a model row that no run uses and that is not being imported; return it.

    Raises:
        NotFound: no such model.
        InUse: a run uses it, or it is still being imported (the message says which).
    """
    with session_scope(engine, immediate=True) as s:
        row = s.get(Model, model_id)
        if row is None:
            raise NotFound(f"no model {model_id!r} is registered")
        if row.status == "pending":
            raise InUse(f"model {row.name!r} is still being imported; delete it once it is "
                        "ready or failed")
        used = s.exec(select(Run.id).where(Run.model_id == row.id).limit(1)).first()
        if used is not None:
            raise InUse(f"model {row.name!r} is used by run {used}; it cannot be deleted "
                        "while runs refer to it")
        s.delete(row)
        return row


def update_model(engine: Engine, model_id: str, **fields: Any) -> Model:
    """Set columns of a model row. Raises NotFound."""
    with session_scope(engine, immediate=True) as s:
        m = s.get(Model, model_id)
        if m is None:
            raise NotFound(f"no model with id {model_id!r}")
        for k, v in fields.items():
            setattr(m, k, v)
        s.add(m)
        return m


# ---- runs -------------------------------------------------------------------------------
def create_run(engine: Engine, spec: TrainSpec, *, kind: str = "sft", name: str | None = None,
               owner: str | None = None, priority: int = 0,
               estimate_gib: float | None = None) -> tuple[Run, Job]:
    """Create a run and queue its training job in one transaction. The run row holds the spec;
    the job's payload only names the run (``{"spec_version", "run_id"}``); ``estimate_gib`` is
    the job's estimated GPU allocator peak in GiB (``app.studio.estimate``), if known.

    ``spec.model`` may be a model id or name; it is resolved to the id. Raises NotFound when the
    model, the dataset or the ``validation_file`` does not exist (or was deleted: checked in
    the transaction, under the rows' lock, so a delete racing it either refuses, seeing the
    new job, or wins and the run is refused).
    """
    model = get_model(engine, spec.model)
    spec = spec.model_copy(update={"model": model.id})
    payload = spec.model_dump(mode="json")
    with session_scope(engine, immediate=True) as s:
        _lock_live_datasets(s, [spec.dataset, payload.get("validation_file")])
        run = Run(name=name, kind=kind, model_id=model.id, dataset_id=spec.dataset, spec=payload,
                  owner=owner)
        s.add(run)
        s.flush()
        job = Job(kind="train" if kind == "sft" else kind,
                  payload={"spec_version": payload["spec_version"], "run_id": run.id},
                  priority=priority, run_id=run.id, owner=owner, max_attempts=3,
                  estimate_gib=estimate_gib)
        s.add(job)
        s.flush()
        run.job_id = job.id
        s.add(run)
        events.append(s, job.id, "state", {"state": JobState.QUEUED})
        return run, job


def resume_run(engine: Engine, run_id: str, from_step: int, reason: str) -> tuple[Run, Job]:
    """Queue a new training job for a run whose job was cancelled or failed, in one transaction:
    same kind, payload, owner, priority and memory estimate; the run's ``job_id`` names it.

    The new job starts with the earlier job's events up to the checkpoint it resumes from
    (``from_step``): its log, sample and progress events and the metric events with ``step <=
    from_step`` (the steps after it are trained again), then a ``queued`` state event saying
    ``reason``. The earlier job stays as the record of its attempt (its GPU time, its end).

    Raises NotFound (no run, or it has no job, or its dataset or validation_file was deleted:
    checked under the rows' lock, as :func:`create_run`) and InUse (its job is not cancelled or
    failed).
    """
    with session_scope(engine, immediate=True) as s:
        run = s.get(Run, run_id)
        old = s.get(Job, run.job_id) if run is not None and run.job_id is not None else None
        if old is None:
            raise NotFound(f"no fine-tuning job with id {run_id!r}")
        if old.state not in (JobState.CANCELLED, JobState.FAILED):
            raise InUse(f"fine-tuning job {run_id} is {old.state}")
        _lock_live_datasets(s, [run.dataset_id, (run.spec or {}).get("validation_file")])
        job = Job(kind=old.kind, payload=old.payload, priority=old.priority, run_id=run.id,
                  owner=old.owner, max_attempts=old.max_attempts, estimate_gib=old.estimate_gib)
        s.add(job)
        s.flush()
        for ev in s.exec(select(JobEvent).where(JobEvent.job_id == old.id,
                                                JobEvent.type != "state")
                         .order_by(JobEvent.id)).all():
            step = ev.data.get("step") if ev.type == "metric" else None
            if not isinstance(step, (int, float)) or step <= from_step:
                s.add(JobEvent(job_id=job.id, ts=ev.ts, type=ev.type, data=ev.data))
        events.append(s, job.id, "state", {"state": JobState.QUEUED, "reason": reason})
        run.job_id = job.id
        s.add(run)
        return run, job


def delete_run(engine: Engine, run_id: str) -> tuple[Run, list[Artifact], list[Job]]:
    """Delete a run whose jobs have all ended, in one transaction: the run row, its artifact
    rows, its export jobs and every event of its jobs. Its training jobs stay (without their
    run) as the record of the GPU time they used (quotas count it). Returns (run, its artifacts,
    its export jobs) so the caller can delete their files.

    Raises NotFound, and InUse whose ``busy`` lists every job (training, export, ...) still
    queued or running.
    """
    with session_scope(engine, immediate=True) as s:
        run = s.get(Run, run_id)
        if run is None:
            raise NotFound(f"no fine-tuning job with id {run_id!r}")
        jobs = list(s.exec(select(Job).where(Job.run_id == run_id)).all())
        busy = sorted((j.id, j.kind, str(j.state)) for j in jobs if j.state in ACTIVE)
        if busy:
            raise InUse(f"run {run_id} is in use: job {busy[0][0]} is {busy[0][2]}", run_id,
                        busy[0][1], busy)
        arts = list(s.exec(select(Artifact).where(Artifact.run_id == run_id)).all())
        for a in arts:
            s.delete(a)
        _delete_events(s, [j.id for j in jobs])
        exports = [j for j in jobs if j.kind == "export"]
        for j in jobs:
            if j.kind == "export":
                s.delete(j)
            else:
                j.run_id = None
                s.add(j)
        s.delete(run)
        return run, arts, exports


def delete_export(engine: Engine, job_id: int) -> tuple[Job, list[Artifact]]:
    """Delete an export job that has ended, its events and its artifact rows, in one
    transaction; returns (job, artifacts) so the caller can delete the files. Raises NotFound
    and InUse (it is queued or running: being built)."""
    with session_scope(engine, immediate=True) as s:
        job = s.get(Job, job_id)
        if job is None or job.kind != "export":
            raise NotFound(f"no export with id {job_id}")
        if job.state in ACTIVE:
            raise InUse(f"export {job_id} is being built ({job.state}); cancel it or wait "
                        "until it ends")
        arts = list(s.exec(select(Artifact).where(Artifact.job_id == job_id)).all())
        for a in arts:
            s.delete(a)
        _delete_events(s, [job_id])
        s.delete(job)
        return job, arts


def _delete_events(session, job_ids: list[int]) -> None:
    from sqlalchemy import delete

    if job_ids:
        session.execute(delete(JobEvent).where(JobEvent.job_id.in_(job_ids)))


def get_run(engine: Engine, run_id: str) -> Run:
    """Load a run by id. Raises NotFound."""
    with session_scope(engine) as s:
        run = s.get(Run, run_id)
        if run is None:
            raise NotFound(f"no fine-tuning job with id {run_id!r}")
        return run


def list_runs(engine: Engine, limit: int = 100, after: str | None = None,
              owner: str | None = None) -> list[Run]:
    """Runs, newest first; ``after`` is a run id for cursor pagination (OpenAI style); only the
    runs of user id ``owner`` when it is given."""
    with session_scope(engine) as s:
        q = select(Run).order_by(Run.created_at.desc(), Run.id.desc())
        if owner is not None:
            q = q.where(Run.owner == owner)
        if after:
            pivot = s.get(Run, after)
            if pivot is not None:
                q = q.where(Run.created_at < pivot.created_at)
        return list(s.exec(q.limit(limit)).all())


def run_with_job(engine: Engine, run_id: str) -> tuple[Run, Job | None]:
    """A run and its (training) job. Raises NotFound."""
    with session_scope(engine) as s:
        run = s.get(Run, run_id)
        if run is None:
            raise NotFound(f"no fine-tuning job with id {run_id!r}")
        job = s.get(Job, run.job_id) if run.job_id is not None else None
        return run, job


def succeeded_runs(engine: Engine, owner: str | None = None) -> list[tuple[Run, Job]]:
    """Runs whose training job succeeded (each has a fine-tuned model), oldest finish first;
    only those of user id ``owner`` when it is given."""
    with session_scope(engine) as s:
        q = (select(Run, Job).join(Job, Job.id == Run.job_id)
             .where(Job.state == JobState.SUCCEEDED).order_by(Job.finished_at, Run.id))
        if owner is not None:
            q = q.where(Run.owner == owner)
        return [(run, job) for run, job in s.exec(q).all()]


def set_run_output(engine: Engine, run_id: str, output_dir: str) -> None:
    """Record the run's output folder (under data_dir/runs)."""
    with session_scope(engine, immediate=True) as s:
        run = s.get(Run, run_id)
        if run is not None:
            run.output_dir = output_dir
            s.add(run)


# ---- artifacts --------------------------------------------------------------------------
def add_artifact(engine: Engine, art: Artifact) -> Artifact:
    """Insert an artifact row (the file must already be complete at ``art.path``)."""
    with session_scope(engine, immediate=True) as s:
        s.add(art)
        return art


def list_artifacts(engine: Engine, run_id: str, kind: str | None = None) -> list[Artifact]:
    """Artifacts of a run, oldest first, optionally of one kind."""
    with session_scope(engine) as s:
        q = select(Artifact).where(Artifact.run_id == run_id).order_by(Artifact.created_at)
        if kind:
            q = q.where(Artifact.kind == kind)
        return list(s.exec(q).all())


def delete_job_artifacts(engine: Engine, job_id: int) -> list[Artifact]:
    """Delete the artifact rows job ``job_id`` recorded (a cancelled export or eval); returns
    them so the caller can remove their files."""
    with session_scope(engine, immediate=True) as s:
        arts = list(s.exec(select(Artifact).where(Artifact.job_id == job_id)).all())
        for a in arts:
            s.delete(a)
        return arts


def delete_artifacts(engine: Engine, artifact_ids: list[str]) -> int:
    """Delete the artifact rows ``artifact_ids`` (their files are already gone); returns how
    many were deleted."""
    if not artifact_ids:
        return 0
    with session_scope(engine, immediate=True) as s:
        arts = list(s.exec(select(Artifact).where(Artifact.id.in_(artifact_ids))).all())
        for a in arts:
            s.delete(a)
        return len(arts)


def get_artifact(engine: Engine, artifact_id: str) -> Artifact:
    """Load an artifact by id. Raises NotFound."""
    with session_scope(engine) as s:
        art = s.get(Artifact, artifact_id)
        if art is None:
            raise NotFound(f"no artifact with id {artifact_id!r}")
        return art


# ---- exports (jobs of kind "export" attached to a run) ----------------------------------
def live_run_jobs(engine: Engine, run_id: str) -> list[Job]:
    """The run's queued and running jobs of every kind (its training, exports, checkpoint
    evals, Playground sessions), oldest first."""
    with session_scope(engine) as s:
        q = select(Job).where(Job.run_id == run_id,
                              Job.state.in_([JobState.QUEUED, JobState.RUNNING])).order_by(Job.id)
        return list(s.exec(q).all())


def list_run_jobs(engine: Engine, run_id: str, kind: str) -> list[Job]:
    """Jobs of one kind attached to a run (e.g. its exports), newest first."""
    with session_scope(engine) as s:
        q = select(Job).where(Job.run_id == run_id, Job.kind == kind).order_by(Job.id.desc())
        return list(s.exec(q).all())
