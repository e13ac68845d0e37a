"""Resuming a cancelled or failed run from its newest checkpoint.

The run keeps its id, spec and folder; a new training job is queued for it
(:func:`app.store.repo.resume_run`) and the worker's training job resumes from the newest
complete ``checkpoint-<step>`` of the run folder, exactly as a job requeued after a worker's
death does: the trainer restores the adapter, optimizer, LR scheduler, RNG states and its
position in the data. A training job saves a checkpoint at the step where it is cancelled, so
a cancelled run loses no step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.store import repo
from app.store.schema import Job, JobState, Run
from app.studio import access, audit, calibration
from app.studio.datasets import deleted_input
from app.studio.errors import StudioError
from app.studio.exports import checkpoint_steps
from app.studio.job_states import no_checkpoint_words

if TYPE_CHECKING:
    from app.settings import Settings
    from app.store.schema import User


def resumable(engine: Engine, run: Run, job: Job | None) -> tuple[int | None, str | None]:
    """(the checkpoint step a resume starts from, None) when the run can be resumed now, else
    (None, the reason it cannot, for a user)."""
    if job is None:
        return None, f"run {run.id} has no training job"
    if job.state in (JobState.QUEUED, JobState.RUNNING):
        return None, (f"run {run.id} is {job.state}: its job is still active; resume a run "
                      "once it is cancelled or has failed")
    if job.state == JobState.SUCCEEDED:
        return None, f"run {run.id} already succeeded; there is nothing left to train"
    steps = checkpoint_steps(engine, run.id)
    if not steps:
        return None, f"run {run.id} {no_checkpoint_words(run, job)}; clone it to start again"
    gone = deleted_input(engine, run)
    if gone is not None:
        return None, (f"run {run.name or run.id} {gone}, which was deleted: clone it and pick "
                      "another")
    return steps[0], None


def quota_refusal(engine: Engine, settings: Settings, actor: User, run: Run, job: Job
                  ) -> StudioError | None:
    """Why the run owner's GPU memory quota could never admit the resumed job of ``run``
    (``job``: its current training job, whose ``estimate_gib`` and ``num_gpus`` the new one
    keeps): :func:`app.studio.calibration.job_quota_refusal`, code ``over_gpu_memory_quota``;
    None when it could."""
    return calibration.job_quota_refusal(
        engine, settings, run.owner, job.estimate_gib, int((run.spec or {}).get("num_gpus") or 1),
        f"the resumed job of run {run.id}", calibration.QUOTA_REMEDY, actor)


def resume_state(engine: Engine, settings: Settings, actor: User, run: Run, job: Job | None
                 ) -> dict[str, Any]:
    """Whether ``actor`` can resume ``run`` now, as the run page (before the click) and
    ``/api/runs/{id}`` say it: ``checkpoint_step`` (the step a resume starts from; None when the
    run has none to resume from), ``can_resume``, ``reason`` (why not, for a user; None when it
    can) and ``code`` (``not_resumable``, ``over_gpu_memory_quota``, ``jobs_at_once_zero`` or
    ``owner_disabled``, as :func:`resume_run`
    refuses it; None when it can)."""
    step, why = resumable(engine, run, job)
    problem = None if why is not None else quota_refusal(engine, settings, actor, run, job)
    code = "not_resumable" if why is not None else problem.code if problem else None
    return {"checkpoint_step": step, "can_resume": code is None,
            "reason": why or (problem.message if problem else None), "code": code}


def why_not(state: dict[str, Any], job: Job | None) -> str | None:
    """Why the run page says a run cannot be resumed (under its buttons, and as the disabled
    Resume button's tooltip): ``state``'s reason (:func:`resume_state`) while its job is
    cancelled or failed and it cannot resume; None otherwise (an active or finished run says
    nothing about resuming)."""
    if state["can_resume"] or job is None or job.state not in (JobState.CANCELLED,
                                                               JobState.FAILED):
        return None
    return state["reason"]


def resume_run(engine: Engine, settings: Settings, actor: User, run_id: str
               ) -> tuple[Run, Job]:
    """Queue a cancelled or failed run again; its new job resumes from the run's newest
    checkpoint (the learning-rate schedule, optimizer state, data order and RNG continue).

    Returns (run, the new job).

    Raises:
        StudioError: not_found (unknown or another user's run); conflict (code
            ``not_resumable``) when its job is queued or running, it succeeded, it saved no
            checkpoint, or its dataset or validation_file was deleted since; invalid (code
            ``over_gpu_memory_quota``) when the owner's GPU memory quota could never admit
            the new job, or ``jobs_at_once_zero`` / ``owner_disabled`` when admission would
            hold it (:func:`app.studio.calibration.check_job_quota`).
    """
    run, job = access.run_with_job(engine, actor, run_id)
    step, why = resumable(engine, run, job)
    if why is not None:
        raise StudioError("conflict", why, None, "not_resumable")
    problem = quota_refusal(engine, settings, actor, run, job)
    if problem is not None:
        raise problem
    try:
        run, new = repo.resume_run(engine, run.id, step,
                                   f"resumed from checkpoint-{step} (job {job.id} {job.state})")
    except repo.InUse as exc:  # another request resumed it first
        raise StudioError("conflict", str(exc), None, "not_resumable") from None
    except repo.NotFound:  # its dataset was deleted since the check above
        step, why = resumable(engine, run, job)
        raise StudioError("conflict", why or f"run {run.id} cannot resume now", None,
                          "not_resumable") from None
    audit.record(engine, actor.id, "run.resumed", "run", run.id, job=new.id, previous_job=job.id,
                 checkpoint_step=step)
    return run, new


def cancel_question(engine: Engine, actor, run_id: str) -> str:
    """The confirmation for cancelling ``run_id`` now (asked when the user clicks Cancel, so a
    page loaded while the run was queued does not say "nothing is trained" after it has
    trained): :func:`cancel_outcome` with the newest training step; a run that ended since
    says so. Raises StudioError not_found (unknown or another user's run)."""
    from app.studio import evaluation

    run, job = access.run_with_job(engine, actor, run_id)
    m = evaluation.latest_training_metric(engine, job.id) if job else None
    return cancel_outcome(engine, run, job, (m or {}).get("step")) or \
        "This run has ended; there is nothing to cancel."


def cancel_outcome(engine: Engine, run: Run, job: Job | None, step: int | None) -> str | None:
    """What cancelling the run now keeps, for the confirmation a user answers (None when the run
    cannot be cancelled: no job, or it ended). ``step``: the newest training step reported
    (None before the first). A running job reads the cancel at the end of a step (at most every
    0.2 s, worker.context.CANCEL_POLL_SECONDS), stops there and saves a checkpoint, so it keeps
    one only once a step is done; checkpoints already on disk (a resumed run's) stay. The step
    it names as done is the newest of ``step`` and the newest checkpoint's (the worker records a
    checkpoint before the step metrics that lag it are read: it never says "step 9 is done"
    beside a checkpoint-12)."""
    if job is None or job.state not in (JobState.QUEUED, JobState.RUNNING):
        return None
    if job.state == JobState.QUEUED:
        return ("Cancel this queued run? It has not started: it simply leaves the queue, and "
                "nothing is trained or kept.")
    steps = checkpoint_steps(engine, run.id)
    kept = (f" The {len(steps)} checkpoint{'s' if len(steps) > 1 else ''} saved so far (newest "
            f"at step {steps[0]}) {'are' if len(steps) > 1 else 'is'} kept." if steps else "")
    if step and steps:
        step = max(step, steps[0])
    if not step:
        return ("Cancel this run? It has not finished a training step yet, so cancelling now "
                "saves no checkpoint." + (kept or " Nothing is kept: the run cannot be resumed "
                                                   "or exported, only cloned."))
    return (f"Cancel this run? Training stops within a step or two (step {step} is done) and "
            "saves a checkpoint where it stops; the run can then be resumed or exported from it."
            " If its last step comes first, the run finishes instead." + kept)
