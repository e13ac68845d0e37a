"""Fixtures for GRPO tests: the GSM8K rows in shared/data and stories260K as a HF folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
GSM8K = SHARED_DATA / "grpo" / "gsm8k" / "train.jsonl"
STORIES = SHARED_DATA / "models" / "stories260K"


@pytest.fixture(scope="session")
def gsm8k_rows() -> list[dict]:
    if not GSM8K.exists():
        pytest.skip(f"GSM8K not found at {GSM8K}")
    with GSM8K.open(encoding="utf-8") as fh:
        return [json.loads(line) for _, line in zip(range(200), fh)]


@pytest.fixture(scope="session")
def stories_hf(tmp_path_factory) -> Path:
    if not (STORIES / "stories260K.bin").exists():
        pytest.skip(f"test data not found at {SHARED_DATA}")
    from worker.engine.llama2c import convert

    out = tmp_path_factory.mktemp("stories260K_hf")
    convert(STORIES / "stories260K.bin", STORIES / "tok512.bin", out)
    return out
