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


def missing_checkpoint_words(run: Any, job: Any, step: int, steps: list[int],
                             metric: dict | None) -> str:
    """Why ``run`` (``job`` its training job, or None) has no checkpoint ``step`` on disk, as a
    sentence naming the checkpoints it has (``steps``, newest first). ``metric``: the job's
    newest training metric (``step``, ``total_steps``), or None. The step the run has reached
    is the newer of that metric's step and its newest checkpoint (metrics lag the checkpoint
    rows). A step past the run's last (``total_steps``, else the spec's ``max_steps``) is never
    reached; one past the step reached is not reached yet (a queued or running run) or not
    reached before the run ended; only an older step was not saved (every ``save_steps``) or
    removed by the trainer's ``save_total_limit``."""
    spec = run.spec or {}
    reached = max([int((metric or {}).get("step") or 0), *steps[:1]])
    total = (metric or {}).get("total_steps") or (spec.get("max_steps") or 0)
    state = job.state if job is not None else None
    if isinstance(total, int) and 0 < total < step:
        why = f"the run trains {total} steps, so it never reaches step {step}"
    elif step > reached and state in (JobState.QUEUED, None) or never_started(job):
        why = f"the run has not started training, so it has not reached step {step}"
    elif step > reached and state == JobState.RUNNING:
        why = f"the run has not reached step {step} yet (it is at step {reached})"
    elif step > reached and state == JobState.SUCCEEDED:
        why = f"the run finished at step {reached}, so it never reaches step {step}"
    elif step > reached:
        why = f"the run {state_words(state)} at step {reached}, before it reached step {step}"
    else:
        every = spec.get("save_steps")
        why = (f"the trainer saves one every save_steps = {every if every else '?'} steps and "
               "where the run stops, and keeps only its newest (save_total_limit), removing "
               "older ones")
    have = ", ".join(str(s) for s in steps) or "none"
    return (f"run {run.id} has no checkpoint at step {step} on disk: {why} (checkpoints on "
            f"disk: {have})")
