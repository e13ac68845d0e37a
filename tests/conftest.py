"""Fixtures shared by every suite: where ../shared/data lives and stories260K as a HF folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run under the interpreter. Triton decides interpreter-or-compile
# when a kernel is decorated (module import), and other suites (engine, worker) import kernels/
# before tests/kernels runs, so the switch must be set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()
STORIES = SHARED_DATA / "models" / "stories260K"


def need_shared_data() -> None:
    """Skip the calling test when ../shared/data is absent (CI always has it)."""
    if not (STORIES / "stories260K.bin").exists():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    need_shared_data()
    return SHARED_DATA


@pytest.fixture(scope="session")
def stories_hf(tmp_path_factory) -> Path:
    """The real stories260K (llama2.c) converted once per session to a HF Llama folder."""
    need_shared_data()
    from worker.engine.llama2c import convert

    out = tmp_path_factory.mktemp("stories260K_hf")
    convert(STORIES / "stories260K.bin", STORIES / "tok512.bin", out)
    return out
