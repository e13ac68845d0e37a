"""Ownership: the one place that decides who may see and act on which object.

Every dataset, model, run, export, artifact and job has an owner (a user id). A member sees and
acts on their own objects (and on shared models, read-only); an admin on all. Another user's
object answers exactly like a missing one (``StudioError("not_found")``), so ids do not leak.

Each getter takes the ``actor`` (the signed-in :class:`app.store.schema.User`: ``.id`` and
``.role``) and returns the row or raises :class:`StudioError`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine

from app.store import queue, repo
from app.store.schema import Artifact, Dataset, Job, Model, Run
from app.studio.errors import StudioError, not_found

if TYPE_CHECKING:
    from app.store.schema import User


def is_admin(actor: User | None) -> bool:
    """True when ``actor`` is an enabled user with the admin role."""
    return actor is not None and not actor.disabled and actor.role == "admin"


def can_see(actor: User | None, owner: str | None) -> bool:
    """Whether ``actor`` may see and act on an object owned by user id ``owner``: an admin on
    everything, a member only on their own (an unowned object belongs to the admins), nobody
    when signed out or disabled."""
    if actor is None or actor.disabled:
        return False
    return actor.role == "admin" or (owner is not None and owner == actor.id)


def owner_filter(actor: User) -> str | None:
    """The ``owner`` argument of the ``repo.list_*`` helpers for ``actor``: None (everything) for
    an admin, else the member's own id."""
    return None if is_admin(actor) else actor.id


def require_admin(actor: User | None) -> User:
    """``actor`` if an enabled admin; raises ``StudioError("forbidden")`` otherwise."""
    if not is_admin(actor):
        raise StudioError("forbidden", "only an admin may do this")
    return actor


def _lookup(get, *args):
    """``get(*args)``, or None when it raises NotFound."""
    try:
        return get(*args)
    except (repo.NotFound, queue.JobNotFound, OverflowError):
        return None


def dataset(engine: Engine, actor: User, dataset_id: str) -> Dataset:
    """The dataset ``dataset_id`` if ``actor`` may see it. Raises StudioError not_found."""
    ds = _lookup(repo.get_dataset, engine, dataset_id)
    if ds is None or not can_see(actor, ds.owner):
        raise not_found("dataset", dataset_id)
    return ds


def model(engine: Engine, actor: User, id_or_name: str, *, write: bool = False) -> Model:
    """The model ``id_or_name`` if ``actor`` may use it (own, shared, or admin). Raises
    StudioError: not_found; forbidden with ``write`` (delete, retry) on a shared model the actor
    does not own (only its owner or an admin may)."""
    # an id names one model; a name may be one of several users': the actor's own first, then
    # a shared one, then (an admin) anyone's
    found = repo.models_named(engine, id_or_name)
    mine = [m for m in found if m.owner is not None and m.owner == getattr(actor, "id", None)]
    shared = [m for m in found if m.shared]
    others = [m for m in found if can_see(actor, m.owner)]
    m = next(iter(mine + shared + others), None)
    if m is None or not (can_see(actor, m.owner) or m.shared):
        raise StudioError("not_found", f"no model {id_or_name!r} is registered")
    if write and not can_see(actor, m.owner):
        raise StudioError("forbidden", f"model {m.name!r} is shared with everyone; only an admin "
                                       "may change or delete it")
    return m


def run(engine: Engine, actor: User, run_id: str) -> Run:
    """The run ``run_id`` if ``actor`` may see it. Raises StudioError not_found."""
    r, _ = run_with_job(engine, actor, run_id)
    return r


def run_with_job(engine: Engine, actor: User, run_id: str) -> tuple[Run, Job | None]:
    """The run ``run_id`` and its training job if ``actor`` may see it. Raises StudioError."""
    r, job = _lookup(repo.run_with_job, engine, run_id) or (None, None)
    if r is None or not can_see(actor, r.owner):
        raise StudioError("not_found", f"no fine-tuning job with id {run_id!r}")
    return r, job


def job(engine: Engine, actor: User, job_id: int, kind: str | None = None) -> Job:
    """The queue job ``job_id`` (of ``kind`` when given) if ``actor`` may see it; a job belongs
    to its run's owner when it has a run. Raises StudioError not_found."""
    what = kind or "job"
    j = _lookup(queue.get_job, engine, job_id)
    if j is None or (kind is not None and j.kind != kind):
        raise not_found(what, job_id)
    run_row = _lookup(repo.get_run, engine, j.run_id) if j.run_id else None
    if not can_see(actor, run_row.owner if run_row else j.owner):
        raise not_found(what, job_id)
    return j


def artifact(engine: Engine, actor: User, artifact_id: str) -> Artifact:
    """The artifact ``artifact_id`` if ``actor`` may see its run. Raises StudioError not_found."""
    art = _lookup(repo.get_artifact, engine, artifact_id)
    run_row = _lookup(repo.get_run, engine, art.run_id) if art is not None and art.run_id else None
    if art is None or not can_see(actor, run_row.owner if run_row else None):
        raise not_found("artifact", artifact_id)
    return art
