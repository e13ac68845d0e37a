"""Shared fixtures for worker tests: where ``shared/data`` lives and a converted stories260K."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
STORIES = SHARED_DATA / "models" / "stories260K"


def _need_shared() -> None:
    if not (STORIES / "stories260K.bin").exists():
        pytest.skip(f"test data not found at {SHARED_DATA}")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    _need_shared()
    return SHARED_DATA


@pytest.fixture(scope="session")
def stories_hf(tmp_path_factory) -> Path:
    """stories260K converted to a HF folder once per session."""
    _need_shared()
    from worker.engine.llama2c import convert

    out = tmp_path_factory.mktemp("stories260K_hf")
    convert(STORIES / "stories260K.bin", STORIES / "tok512.bin", out)
    return out
