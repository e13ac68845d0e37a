"""How a job's state reads inside a sentence ("the run failed", "the run was cancelled", "the
run is running"), so messages never say "was failed" or "it is failed"."""
from __future__ import annotations

from typing import Any

from app.store.schema import JobState

_WORDS = {JobState.QUEUED: "is queued", JobState.RUNNING: "is running",
          JobState.SUCCEEDED: "succeeded", JobState.FAILED: "failed",
          JobState.CANCELLED: "was cancelled"}


def state_words(state: str | None) -> str:
    """The predicate for a job in ``state``: ``"failed"``, ``"was cancelled"``,
    ``"succeeded"``, ``"is queued"``, ``"is running"``; ``"has no job"`` for None, and
    ``"is <state>"`` for any other string."""
    if state is None:
        return "has no job"
    return _WORDS.get(state, f"is {state}")


def never_started(job: Any) -> bool:
    """Whether ``job`` (a :class:`~app.store.schema.Job` or None) was cancelled while it was
    still queued: no worker ever took it (no ``started_at``)."""
    return job is not None and job.state == JobState.CANCELLED and job.started_at is None


def no_checkpoint_words(run: Any, job: Any) -> str:
    """Why a cancelled or failed ``run`` (a :class:`~app.store.schema.Run`; ``job`` its job)
    left no checkpoint, as a predicate: ``"was cancelled before it started"`` for a run
    cancelled while queued (:func:`never_started`), else e.g. ``"failed before it saved a
    checkpoint (one is saved every save_steps = 10 steps)"`` (its spec's ``save_steps``)."""
    if never_started(job):
        return "was cancelled before it started"
    save_steps = (run.spec or {}).get("save_steps")
    return (f"{state_words(job.state if job else None)} before it saved a checkpoint (one is "
            f"saved every save_steps = {save_steps if save_steps else '?'} steps)")
