"""The TrainerCallback base both trainers (SFT and GRPO) report through: it stops training on
cancel / lease loss / shutdown and times steps for the ETA of metric events."""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def checkpoint_callback(on_save: Callable[[int, Path, str | None], None]):
    """A TrainerCallback that calls ``on_save(step, folder, best)`` each time the trainer has
    written a checkpoint (``<output_dir>/checkpoint-<step>``, at ``save_steps`` and on
    shutdown); ``best`` is the trainer's ``state.best_model_checkpoint`` (the folder of the best
    eval loss so far, which ``load_best_model_at_end`` loads at the end), or None."""
    from transformers import TrainerCallback

    class CheckpointCallback(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                on_save(state.global_step, folder, state.best_model_checkpoint)
            return control

    return CheckpointCallback()


@functools.cache
def stopping_callback() -> type:
    """The base TrainerCallback class (built on first use, so importing this needs no
    transformers).

    ``StoppingCallback(stop_reason, on_stop)``: ``stop_reason()`` returns ``cancelled`` |
    ``lost`` | ``shutdown`` | None, checked after every step (a job passes
    :meth:`worker.context.JobContext.step_stop_reason`, which reads the cancel flag itself, so
    a cancel stops training within a step or two, not at the next heartbeat); on ``shutdown``
    and ``cancelled`` the trainer also saves a checkpoint before it stops (so a requeued job
    resumes, and a cancelled run can be resumed from the step where it stopped). A cancel
    seen after the last step does not stop anything: training has ended on its own, and the
    job says the cancel came too late (:meth:`worker.context.JobContext.cancel_came_too_late`).
    ``on_stop(reason)`` is told once. :meth:`step_timing` gives (seconds per step, ETA
    seconds) from the steps after this process's first.
    """
    from transformers import TrainerCallback

    class StoppingCallback(TrainerCallback):
        def __init__(self, stop_reason: Callable[[], str | None],
                     on_stop: Callable[[str], None] | None = None):
            self._stop_reason, self._on_stop = stop_reason, on_stop
            self.t0 = time.monotonic()
            self.start_step = 0
            self.first_done: tuple[int, float] | None = None  # (step, monotonic s) of the 1st
            self.stopped: str | None = None

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.monotonic()
            self.start_step = state.global_step
            self.first_done = None

        def on_step_end(self, args, state, control, **kw):
            if self.first_done is None and state.global_step > self.start_step:
                self.first_done = (state.global_step, time.monotonic())
            reason = self._stop_reason()
            if reason == "cancelled" and state.global_step >= state.max_steps:
                return control  # the last step is done: training ends on its own (finished)
            if reason and not self.stopped:
                self.stopped = reason
                control.should_training_stop = True
                # shutdown: the requeued job resumes; cancelled: the run can be resumed (or
                # exported) from the step where it stopped
                control.should_save = reason in ("shutdown", "cancelled")
                if self._on_stop:
                    self._on_stop(reason)
            return control

        def step_timing(self, state, now: float | None = None) -> tuple[Any, Any]:
            """(seconds per step, seconds left): over the steps done after this process's
            first (its warm-up: kernel compiles, the libraries' first use, a resume's loading
            would otherwise inflate every later estimate, by 80% after 20 steps of a 0.3 s
            step behind a 5 s first one); while only the first is done, over that one;
            (None, None) before it."""
            done = state.global_step - self.start_step
            now = time.monotonic() if now is None else now
            first = self.first_done
            if first is not None and state.global_step > first[0]:
                per_step = (now - first[1]) / (state.global_step - first[0])
            else:
                per_step = (now - self.t0) / done if done else None
            eta = per_step * max(state.max_steps - state.global_step, 0) if per_step else None
            return per_step, eta

    return StoppingCallback
