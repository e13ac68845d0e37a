"""The ETA a training job reports (``eta_seconds`` of its step metrics, which the run page, the
queue's estimated starts and ``/v1`` show) leaves the process's first step out once a later one
is done (trial s24 M-4: the ETA jumped after a resume). The first step carries the process's
warm-up (kernel compiles, the libraries' first use, a resume's loading): averaged in, a 5 s
first step before 0.3 s steps put the ETA 80% too high after 20 steps, and it decayed only as
1/steps. Driven through the real callback class with the trainer's own TrainerState."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def _callback(start_step: int, max_steps: int):
    from transformers import TrainerControl, TrainerState

    from worker.engine.callbacks import stopping_callback

    cb = stopping_callback()(lambda: None)
    state = TrainerState(global_step=start_step, max_steps=max_steps)
    cb.on_train_begin(None, state, TrainerControl())
    return cb, state


def _step(cb, state, at: float, monkeypatch) -> None:
    from transformers import TrainerControl

    import worker.engine.callbacks as callbacks
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: at)
    state.global_step += 1
    cb.on_step_end(None, state, TrainerControl())


@pytest.mark.parametrize("start_step", [0, 40])  # a fresh run; one resumed from checkpoint-40
def test_the_eta_leaves_the_warm_up_step_out(start_step, monkeypatch):
    cb, state = _callback(start_step, 100)
    t0 = cb.t0
    assert cb.step_timing(state, t0 + 1.0) == (None, None)  # no step yet
    _step(cb, state, t0 + 5.0, monkeypatch)  # the first step: 5 s of warm-up
    per_step, eta = cb.step_timing(state, t0 + 5.0)
    assert per_step == pytest.approx(5.0)  # all it knows yet
    assert eta == pytest.approx(5.0 * (100 - start_step - 1))
    for i in range(1, 20):  # then 0.3 s a step
        _step(cb, state, t0 + 5.0 + 0.3 * i, monkeypatch)
    per_step, eta = cb.step_timing(state, t0 + 5.0 + 0.3 * 19)
    assert per_step == pytest.approx(0.3)
    # (the whole-time average it used before: (5 + 19 x 0.3) / 20 = 0.535 s a step, 78% high)
    assert eta == pytest.approx(0.3 * (100 - start_step - 20))
