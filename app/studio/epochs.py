"""How many epochs a run does (or did): the ``hyperparameters.n_epochs`` that /v1 reports.

transformers' Trainer lets ``max_steps > 0`` override ``num_train_epochs`` and then trains
``ceil(max_steps / optimizer steps per epoch)`` epochs, so a run limited by max_steps on a
small dataset can run many more epochs than its ``num_train_epochs`` says.
"""
from __future__ import annotations

import math
from typing import Any

from sqlalchemy.engine import Engine

from app.store import events, repo
from app.store.schema import Job, Run

#: What ``n_epochs`` says when the count is not known yet (OpenAI's own placeholder).
AUTO = "auto"
#: Why a /v1 job naming both ``hyperparameters.n_epochs`` and ``max_steps`` is refused: the
#: Trainer trains ``max_steps`` whatever the epochs say, and ``n_epochs`` would read back as the
#: epochs those steps make, not the number asked for (trial s22, F3).
EPOCHS_OR_STEPS = ("give hyperparameters.n_epochs or max_steps, not both: max_steps trains that "
                   "many optimizer steps whatever n_epochs says")


def _whole(x: Any) -> Any:
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _steps_per_epoch_logged(engine: Engine, job: Job | None) -> int | None:
    """Optimizer steps per epoch as the trainer logged them: ``step / epoch`` of the newest
    training metric event that has both (floored: an epoch's trailing micro-batches that do
    not fill a gradient-accumulation step add no optimizer step)."""
    if job is None:
        return None
    for ev in events.recent(engine, job.id, "metric", 20):
        d = ev.data or {}
        step, epoch = d.get("step"), d.get("epoch")
        if isinstance(step, int) and step > 0 and isinstance(epoch, (int, float)) and epoch > 0:
            return max(1, math.floor(step / epoch + 1e-3))
    return None


def _steps_per_epoch_planned(engine: Engine, spec: dict[str, Any], dataset_id: str) -> int | None:
    """Optimizer steps per epoch from the dataset's row count: the training rows (less the
    held-out percentage) in batches of ``per_device_train_batch_size``, rounded up, divided by
    ``gradient_accumulation_steps`` (at least 1). None when unknown: rows not counted yet, or
    ``packing`` (which changes how many sequences the rows make)."""
    if spec.get("packing"):
        return None
    try:
        rows = repo.get_dataset(engine, dataset_id, deleted=True).rows  # a finished run's too
    except repo.NotFound:
        return None
    if not rows:
        return None
    pct = spec.get("validation_split_percentage")
    if pct and not spec.get("validation_file"):
        rows -= max(1, round(rows * pct / 100))
    batches = math.ceil(max(rows, 1) / int(spec.get("per_device_train_batch_size") or 1))
    return max(1, batches // int(spec.get("gradient_accumulation_steps") or 1))


def n_epochs(engine: Engine, run: Run, job: Job | None) -> int | float | str:
    """The epochs ``run`` trains (or trained), as OpenAI's ``hyperparameters.n_epochs``.

    Rule: with ``max_steps <= 0`` the run trains ``num_train_epochs`` (an int when whole).
    With ``max_steps > 0`` it trains ``ceil(max_steps / steps per epoch)`` epochs (the Trainer's
    own count), steps per epoch taken from the trainer's logged progress once a metric event
    has ``step`` and ``epoch``, else planned from the dataset's rows
    (:func:`_steps_per_epoch_planned`); :data:`AUTO` (``"auto"``) when neither is known.
    """
    spec = run.spec or {}
    max_steps = int(spec.get("max_steps") or -1)
    if max_steps <= 0:
        return _whole(spec.get("num_train_epochs", 1.0))
    per_epoch = (_steps_per_epoch_logged(engine, job)
                 or _steps_per_epoch_planned(engine, spec, run.dataset_id))
    return AUTO if per_epoch is None else math.ceil(max_steps / per_epoch)


def planned_steps(engine: Engine, run: Run) -> int | None:
    """The optimizer steps ``run`` will train, planned before it starts: ``max_steps`` when
    positive (GRPO always), else ``num_train_epochs`` (rounded up) times the steps per epoch
    planned from the dataset's rows (:func:`_steps_per_epoch_planned`); None when unknown."""
    spec = run.spec or {}
    max_steps = int(spec.get("max_steps") or -1)
    if max_steps > 0:
        return max_steps
    per_epoch = _steps_per_epoch_planned(engine, spec, run.dataset_id)
    epochs = float(spec.get("num_train_epochs") or 1.0)
    return None if per_epoch is None else max(1, math.ceil(per_epoch * epochs))
