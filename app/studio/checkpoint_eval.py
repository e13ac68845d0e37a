"""On-demand generation eval of a run's checkpoints (SFT and GRPO): queueing one, refusing one
that cannot run, and what the run page and ``/api`` show of them.

An eval is a queue job of kind ``evaluate`` attached to its run (``run_id``), owned by the run's
owner, with the run's held-out set and the checkpoint's adapter (:mod:`worker.jobs.
checkpoint_eval`); it runs on a GPU slot like training, admitted by its estimated memory
(:func:`estimate_gib`). Its result (and a JSON artifact ``checkpoint_eval``) is the checkpoint's
table: ``generation_eval`` for SFT, ``reward_eval`` for GRPO, the same tables the end of a run
makes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.store import queue, repo
from app.store.schema import Job, JobState, Run
from app.store.specs import ALL_LINEAR
from app.studio import access, audit, calibration, jobs
from app.studio.datasets import deleted_input
from app.studio.errors import StudioError, invalid, not_found, whole
from app.studio.job_states import missing_checkpoint_words

if TYPE_CHECKING:
    from app.settings import Settings
    from app.store.schema import User

#: The job kind.
KIND = "evaluate"
#: Held-out prompts an eval answers when the run's spec asks for none (and the most allowed).
DEFAULT_SAMPLES, MAX_SAMPLES = 8, 100
#: New tokens of an SFT eval's greedy answer at most (worker.jobs.evaluation.MAX_NEW_TOKENS).
SFT_NEW_TOKENS = 256
#: Allocator slack of a generation job besides weights, adapter, KV cache and logits (GiB).
GENERATION_SLACK_GIB = 0.25


def has_held_out(spec: dict[str, Any]) -> bool:
    """Whether a run's spec names a held-out set (``validation_file`` or a percentage)."""
    return bool(spec.get("validation_file") or spec.get("validation_split_percentage"))


def default_samples(run: Run) -> int:
    """How many held-out prompts an eval of ``run``'s checkpoints answers by default: the
    spec's own count (``generation_eval_samples`` / ``reward_eval_samples``), else
    :data:`DEFAULT_SAMPLES`; at most :data:`MAX_SAMPLES`."""
    spec = run.spec or {}
    n = spec.get("reward_eval_samples" if run.kind == "grpo" else "generation_eval_samples")
    return min(MAX_SAMPLES, int(n or DEFAULT_SAMPLES))


def checkpoint_steps(engine: Engine, run_id: str) -> list[int]:
    """The steps of the run's checkpoints on disk that hold an adapter, newest first."""
    from app.studio.exports import checkpoint_steps as on_disk

    return on_disk(engine, run_id)


def not_on_disk(engine: Engine, run_id: str, step: Any, steps: list[int] | None = None,
                field: str = "checkpoint_step", code: str | None = None) -> StudioError | None:
    """StudioError not_found (naming ``field``, with ``code``) listing the steps on disk when
    run ``run_id`` has no checkpoint ``step`` on disk (pruned, or never saved); None when it has.
    ``steps``: the run's :func:`checkpoint_steps`, when already read."""
    steps = checkpoint_steps(engine, run_id) if steps is None else steps
    if step in steps:
        return None
    return StudioError("not_found", missing_words(engine, run_id, step, steps), field, code)


def missing_words(engine: Engine, run_id: str, step: int, steps: list[int]) -> str:
    """Why run ``run_id`` has no checkpoint ``step`` on disk (``steps``: the ones it has, newest
    first), from its job and newest training metric:
    :func:`app.studio.job_states.missing_checkpoint_words` (not reached yet, never reached, or
    not saved / removed by ``save_total_limit``)."""
    from app.studio.evaluation import latest_training_metric

    run, job = repo.run_with_job(engine, run_id)
    metric = latest_training_metric(engine, job.id) if job is not None else None
    return missing_checkpoint_words(run, job, step, steps, metric)


def eval_jobs(engine: Engine, run_id: str) -> list[Job]:
    """The run's ``evaluate`` jobs, newest first."""
    return repo.list_run_jobs(engine, run_id, KIND)


def estimate_gib(engine: Engine, run: Run) -> float | None:
    """The eval job's estimated GPU allocator peak (GiB): the base weights (bf16, or NF4 with
    ``load_in_4bit``), the fp32 adapter, one sequence's KV cache and fp32 logits (prompt +
    new tokens: ``max_seq_length`` + 256 for SFT, ``max_prompt_length`` +
    ``max_completion_length`` for GRPO) and a fixed slack; None when the model's shape is
    unknown (the job is then admitted alone on a GPU)."""
    from app.studio import estimate as est

    try:
        model = repo.get_model(engine, run.model_id)
    except repo.NotFound:
        return None
    shape = est.model_shape(model.info, model.path)
    if shape is None:
        return None
    spec = run.spec or {}
    if run.kind == "grpo":
        seq = int(spec.get("max_prompt_length", 256)) + int(spec.get("max_completion_length", 256))
    else:
        seq = int(spec.get("max_seq_length", 1024)) + SFT_NEW_TOKENS
    weights = est.weight_bytes(shape, bool(spec.get("load_in_4bit")))
    targets = list(spec.get("target_modules") or ALL_LINEAR)
    adapter = est.lora_params(shape, int(spec.get("r", 16)), targets) * 4
    kv = seq * shape.layers * 2 * shape.kv_heads * shape.head_dim * 2
    logits = seq * shape.vocab * 4
    return round((weights + adapter + kv + logits) / est.GIB + GENERATION_SLACK_GIB, 4)


def evaluating(step: int, jobs: list[Job]) -> Job | None:
    """The queued or running eval of checkpoint ``step`` among a run's eval ``jobs`` (None when
    there is none)."""
    return next((j for j in jobs if j.state in (JobState.QUEUED, JobState.RUNNING)
                 and (j.payload or {}).get("checkpoint_step") == step), None)


def refusal(engine: Engine, run: Run, step: int, steps: list[int] | None = None,
            jobs: list[Job] | None = None, settings: Settings | None = None,
            actor: User | None = None) -> StudioError | None:
    """Why checkpoint ``step`` of ``run`` cannot be evaluated now (None: it can): the run has
    no held-out set or its dataset or validation_file was deleted (conflict), no such
    checkpoint on disk (not_found, field
    ``checkpoint_step``), an eval of it is already queued or running (conflict, code
    ``being_evaluated``), or, with
    ``settings`` (``actor``: who asks), the run owner's GPU memory quota could never admit
    the eval (invalid, code ``over_gpu_memory_quota``:
    :func:`app.studio.calibration.job_quota_refusal`). ``steps`` / ``jobs``: the run's
    checkpoint steps and eval jobs, when already read."""
    if not has_held_out(run.spec or {}):
        return StudioError("conflict", f"run {run.name or run.id} has no held-out set to evaluate "
                           "on: it was created without validation_file or "
                           "validation_split_percentage")
    gone = deleted_input(engine, run)  # the worker rebuilds the held-out set from both
    if gone is not None:
        return StudioError("conflict", f"run {run.name or run.id} {gone}, which was deleted; "
                           "its held-out set cannot be rebuilt to evaluate a checkpoint")
    missing = not_on_disk(engine, run.id, step, steps)
    if missing is not None:
        return missing
    job = evaluating(step, eval_jobs(engine, run.id) if jobs is None else jobs)
    if job is not None:
        return StudioError("conflict", f"checkpoint-{step} of run {run.name or run.id} is already "
                           f"being evaluated (evaluation {job.id}, {job.state}); cancel that "
                           "evaluation to evaluate it again", None, "being_evaluated")
    if settings is not None:
        return calibration.job_quota_refusal(
            engine, settings, run.owner, estimate_gib(engine, run), 1,
            f"this evaluation of checkpoint {step}", calibration.QUOTA_REMEDY, actor)
    return None


def queue_eval(engine: Engine, settings: Settings, actor: User, run_id: str, step: Any,
               samples: Any = None) -> Job:
    """Queue the generation eval of checkpoint ``step`` of run ``run_id`` on up to ``samples``
    held-out prompts (default :func:`default_samples`).

    Raises StudioError: not_found (unknown or another user's run; no such checkpoint),
    conflict (no held-out set; that checkpoint's eval already queued or running), invalid
    (``checkpoint_step`` or ``samples`` not a whole number in range; code
    ``over_gpu_memory_quota``: the run owner's GPU memory quota could never admit the eval,
    :func:`app.studio.calibration.check_job_quota`)."""
    run = access.run(engine, actor, run_id)
    step = whole(step)
    if step is None:
        raise invalid("checkpoint_step", "must be a whole number (a checkpoint's step)")
    if samples in (None, ""):
        n = default_samples(run)
    else:
        n = whole(samples) or 0  # 2.5, 1e999 or True is no count
        if not 1 <= n <= MAX_SAMPLES:
            raise invalid("samples", f"must be a whole number from 1 to {MAX_SAMPLES}")
    problem = refusal(engine, run, step, settings=settings, actor=actor)
    if problem is not None:
        raise problem
    need = estimate_gib(engine, run)
    job = queue.enqueue(engine, KIND, {"spec_version": 1, "run_id": run.id,
                                       "checkpoint_step": step, "samples": n},
                        run_id=run.id, owner=run.owner, max_attempts=2, estimate_gib=need)
    audit.record(engine, actor.id, "run.checkpoint_eval", "run", run.id, step=step, job=job.id)
    return job


def eval_job(engine: Engine, actor: User, eval_id: int) -> Job:
    """The ``evaluate`` job ``eval_id`` if ``actor`` may see its run. Raises StudioError
    not_found."""
    try:
        return access.job(engine, actor, eval_id, kind=KIND)
    except StudioError:
        raise not_found("evaluation", eval_id) from None


def cancel_eval(engine: Engine, actor: User, eval_id: int) -> Job:
    """Cancel checkpoint eval ``eval_id`` while it is queued or running (its run's owner or an
    admin); the worker stops it before it writes its table (:func:`app.studio.jobs.cancel`).
    Raises StudioError: not_found (unknown, or another user's); conflict when it already
    ended."""
    return jobs.cancel(engine, actor, eval_job(engine, actor, eval_id),
                       f"evaluation {eval_id}", "evaluation")


def eval_info(job: Job) -> dict[str, Any]:
    """One checkpoint eval as the run page and ``/api`` show it: ``id``, ``checkpoint_step``,
    ``samples``, ``status``, ``error``, ``cancel_requested``, timestamps, ``held_out`` and the table
    (``generation_eval`` or ``reward_eval``; None until it succeeded)."""
    payload, result = job.payload or {}, job.result or {}
    return {"id": job.id, "run_id": job.run_id, "checkpoint_step": payload.get("checkpoint_step"),
            "samples": payload.get("samples"), "status": job.state, "error": job.error,
            "cancel_requested": bool(job.cancel_requested),
            "created_at": job.created_at, "finished_at": job.finished_at,
            "held_out": result.get("held_out"),
            "generation_eval": result.get("generation_eval"),
            "reward_eval": result.get("reward_eval")}


def checkpoint_evals(engine: Engine, run: Run, settings: Settings | None = None,
                     actor: User | None = None) -> dict[str, Any]:
    """The checkpoints part of a run's evaluation: ``checkpoints`` (each on-disk step with
    ``can_evaluate``, the ``reason`` it cannot and its ``code``, newest first: :func:`refusal`,
    the GPU memory quota included with ``settings``; ``evaluation``: ``{"id", "status"}`` of
    its eval while one is queued or running, which the run page shows in place of the
    button, else None), ``evals``
    (every eval job, newest first: :func:`eval_info`) and ``active`` (whether one is queued
    or running)."""
    jobs, steps = eval_jobs(engine, run.id), checkpoint_steps(engine, run.id)
    rows = []
    for step in steps:
        problem = refusal(engine, run, step, steps, jobs, settings, actor)
        busy = evaluating(step, jobs)
        rows.append({"step": step, "can_evaluate": problem is None,
                     "reason": None if problem is None else problem.message,
                     "code": None if problem is None else problem.code,
                     "evaluation": None if busy is None else {"id": busy.id,
                                                              "status": busy.state}})
    return {"checkpoints": rows, "evals": [eval_info(j) for j in jobs],
            "active": any(j.state in (JobState.QUEUED, JobState.RUNNING) for j in jobs),
            "default_samples": default_samples(run)}


def shown_reasons(evaluation: dict[str, Any] | None) -> list[str]:
    """The reasons the run page's Evaluation card prints beside its checkpoints' disabled
    Evaluate buttons (``evaluation``: :func:`app.studio.evaluation.run_evaluation`'s); a
    checkpoint being evaluated shows that instead (``evaluation``), so a refused second
    Evaluate click is said above the list."""
    rows = ((evaluation or {}).get("checkpoints") or {}).get("checkpoints") or []
    return [c["reason"] for c in rows if not c["can_evaluate"] and c["reason"]
            and not c.get("evaluation")]


def run_evaluations(engine: Engine, settings: Settings, actor: User, run_id: str
                    ) -> dict[str, Any]:
    """Everything evaluated of a run (``GET /api/runs/{id}/evaluations``): ``held_out`` (where
    from), ``end_of_run`` (the training job's ``eval``, ``generation_eval`` and
    ``reward_eval`` result entries) and the checkpoints (:func:`checkpoint_evals`, the GPU
    memory quota included). Raises StudioError not_found."""
    from app.studio.evaluation import held_out_text

    run, job = access.run_with_job(engine, actor, run_id)
    result = (job.result or {}) if job is not None else {}
    return {"run_id": run.id, "kind": run.kind, "held_out": held_out_text(run.spec or {}),
            "end_of_run": {k: result.get(k) for k in ("eval", "generation_eval", "reward_eval")},
            **checkpoint_evals(engine, run, settings, actor)}
