"""How a job's state reads inside a sentence ("the run failed", "the run was cancelled", "the
run is running"), so messages never say "was failed" or "it is failed"."""
from __future__ import annotations

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
