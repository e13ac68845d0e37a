"""common.frozen_gc: objects alive at entry are out of the cyclic GC during training and back after,
also when training raises."""
from __future__ import annotations

import gc

import pytest

from worker.jobs.common import frozen_gc


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic GC can free it


def test_frozen_gc_freezes_then_restores():
    """A cycle that exists at entry is not scanned (not freed) inside, and is freed after."""
    import weakref

    before = _Node()
    ref = weakref.ref(before)
    assert gc.get_freeze_count() == 0
    with frozen_gc():
        assert gc.get_freeze_count() > 0
        del before
        gc.collect()
        assert ref() is not None  # frozen: the collector does not look at it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_frozen_gc_unfreezes_when_the_body_raises():
    with pytest.raises(RuntimeError):
        with frozen_gc():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("training failed")
    assert gc.get_freeze_count() == 0


def test_cycles_made_during_training_are_still_collected():
    import weakref

    with frozen_gc():
        n = _Node()
        ref = weakref.ref(n)
        del n
        gc.collect()
        assert ref() is None
