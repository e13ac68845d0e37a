"""The zero-variance watch: a GRPO run whose groups all score alike says it is not learning."""
from __future__ import annotations

from worker.engine.grpo_health import ZeroVarianceWatch


def test_warns_once_after_patience_steps_and_again_after_a_relapse():
    w = ZeroVarianceWatch(threshold=0.9, patience=3)
    seen = [w.observe(s, f, 8) for s, f in enumerate([1.0, 0.95, 1.0, 1.0, 0.9], start=1)]
    assert seen[:2] == [None, None] and seen[3:] == [None, None]
    assert seen[2] is not None and "for 3 steps (up to step 3)" in seen[2]
    assert "100% of 8 groups" in seen[2] and "num_generations" in seen[2]
    one = ZeroVarianceWatch(patience=1).observe(1, 1.0, 1.0)  # the trainer logs a mean: a float
    assert "100% of 1 group had" in one and "1.0" not in one
    assert w.observe(6, 0.5) is None  # learning again: the streak resets
    assert [w.observe(s, 1.0) for s in (7, 8)] == [None, None]
    again = w.observe(9, 1.0)
    assert again is not None and "(up to step 9)" in again and "of the groups" in again


def test_healthy_or_unknown_steps_never_warn():
    w = ZeroVarianceWatch()
    assert all(w.observe(s, f) is None for s, f in enumerate([0.2, None, 0.89, None, 0.0] * 4))
