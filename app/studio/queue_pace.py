"""How long a training job will take before it has timed a step of its own: the queue's estimate
(:mod:`app.studio.queue_view`) for a running ``train``/``grpo`` job with no ``eta_seconds`` metric
yet, and for a waiting one placed ahead of others.

The median duration of a kind mixes runs of every length: behind a 200-step run, a queue that
had seen only 5-step runs said "starts in 17 s" for a start 62 s away (trial s21, F13). A job's
length is its planned optimizer steps (``max_steps``, else the steps per epoch planned from the
dataset's rows times ``num_train_epochs``: :func:`app.studio.epochs.planned_steps`) at the pace
of the recent succeeded jobs of its kind, preferring those of the same model: the median seconds
a step (``train_runtime / steps`` from their results) and the median seconds around the
training (model load, tokenisation, saving, the end-of-run eval: the job's whole duration less
``train_runtime``). Jobs that were claimed more than once (resumed: their ``steps`` count the
steps of earlier attempts) are left out.

When the steps or the pace are unknown, the caller falls back to the kind's median duration
(:func:`app.studio.queue_cpu.typical_seconds`).
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.store.schema import Job, JobState, Run
from app.studio import epochs

#: Job kinds whose length is counted in optimizer steps.
STEPPED_KINDS = ("train", "grpo")
#: How many recent succeeded jobs of a kind set its pace.
HISTORY = 20


@dataclass(frozen=True)
class Pace:
    """Seconds a job of a kind takes: ``overhead`` + ``per_step`` x its optimizer steps."""

    per_step: float
    overhead: float

    def seconds(self, steps: int) -> float:
        """The whole job's seconds for ``steps`` optimizer steps."""
        return self.overhead + self.per_step * steps


def paces(s, kinds: set[str], on_gpu: bool = True) -> dict[tuple[str, str | None], Pace]:
    """``(kind, model_id) -> Pace`` from the :data:`HISTORY` newest succeeded single-attempt jobs
    of each stepped kind in ``kinds`` (``on_gpu``: only those admitted to a GPU slot), per model
    and under ``(kind, None)`` for all models of the kind; kinds without such jobs are absent.
    ``s`` is an open session."""
    out: dict[tuple[str, str | None], Pace] = {}
    for kind in sorted(set(kinds) & set(STEPPED_KINDS)):
        q = (select(Job.started_at, Job.finished_at, Job.result, Run.model_id)
             .join(Run, Run.id == Job.run_id)
             .where(Job.kind == kind, Job.state == JobState.SUCCEEDED, Job.attempts <= 1))
        if on_gpu:
            q = q.where(Job.gpu_slot.is_not(None))
        samples: dict[str | None, list[tuple[float, float]]] = {}
        for started, finished, result, model_id in s.exec(q.order_by(Job.id.desc())
                                                          .limit(HISTORY)).all():
            result = result or {}
            steps, runtime = result.get("steps"), result.get("train_runtime")
            if not (started and finished and isinstance(steps, int) and steps > 0
                    and isinstance(runtime, (int, float)) and runtime > 0):
                continue
            sample = (runtime / steps, max(0.0, finished - started - runtime))
            samples.setdefault(model_id, []).append(sample)
            samples.setdefault(None, []).append(sample)
        for model_id, rows in samples.items():
            out[(kind, model_id)] = Pace(median(r[0] for r in rows), median(r[1] for r in rows))
    return out


def planned_seconds(engine: Engine, job: Job, run: Run | None,
                    known: dict[tuple[str, str | None], Pace]) -> float | None:
    """The whole seconds ``job`` (of ``run``) should take from its claim to its end: its planned
    optimizer steps at the pace of its model's recent jobs (else its kind's); None when the job
    is not a stepped kind, has no run, its steps are not known yet (``packing`` with
    ``num_train_epochs``, rows not counted) or no job of its kind has succeeded."""
    if job.kind not in STEPPED_KINDS or run is None:
        return None
    pace = known.get((job.kind, run.model_id)) or known.get((job.kind, None))
    if pace is None:
        return None
    steps = epochs.planned_steps(engine, run)
    return None if steps is None else pace.seconds(steps)
