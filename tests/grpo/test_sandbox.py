"""Custom rewards in the sandbox process: results, time and memory limits, exceptions."""
from __future__ import annotations

import re
import time

import pytest

from worker.rewards.base import Batch, RewardError, score_all, validate
from worker.rewards.sandbox import SandboxedReward


def _batch(n=4):
    return Batch([f"p{i}" for i in range(n)], ["Lily went home", "a cat", "Lily and Tom", "x"][:n],
                 [3] * n, {"answer": ["a", "b", "c", "d"][:n]})


def _reward(src, **kw):
    return SandboxedReward("mine", src, **kw)


def test_custom_reward_scores_and_sees_columns():
    r = _reward("import re\n"
                "def reward(prompt, completion, item):\n"
                "    print('debug output must not break the protocol')\n"
                "    return float('Lily' in completion) + (item['answer'] == 'c')\n")
    try:
        b = _batch()
        assert validate(r.name, r.score(b), b) == [1.0, 0.0, 2.0, 0.0]
        assert r.score(b) == [1.0, 0.0, 2.0, 0.0]  # process reused
        pid = r._proc.pid
        r.score(b)
        assert r._proc.pid == pid
    finally:
        r.close()


def test_openai_grade_style():
    r = _reward("def grade(sample, item):\n    return len(sample['output_text']) > 5\n",
                entry="grade", style="openai")
    try:
        assert r.score(_batch()) == [1.0, 0.0, 1.0, 0.0]
    finally:
        r.close()


def test_timeout_kills_the_process():
    r = _reward("def reward(prompt, completion, item):\n    while True:\n        pass\n",
                timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"'mine' took longer than its 1 s limit"):
        r.score(_batch())
    assert time.monotonic() - t0 < 8
    assert r._proc is None


def test_memory_limit():
    r = _reward("def reward(prompt, completion, item):\n"
                "    block = bytearray(800 * 1024 * 1024)\n    return 1.0\n", memory_mb=256)
    try:
        with pytest.raises(RewardError, match=r"'mine' raised MemoryError.*#0"):
            r.score(_batch())
    finally:
        r.close()


def test_exception_names_sample():
    r = _reward("def reward(prompt, completion, item):\n"
                "    return 1 / (len(completion) - 1)\n")
    try:
        with pytest.raises(RewardError) as ei:
            score_all([r], _batch(), 2)
        msg = str(ei.value)
        assert "'mine' raised ZeroDivisionError" in msg and "#3" in msg and "'x'" in msg
    finally:
        r.close()


@pytest.mark.parametrize("body, needle", [
    ("return None", "returned None"),
    ("return 'high'", "returned a str ('high'), not a number"),
    ("return float('nan')", "returned nan"),
    ("return [1, 2]", "returned a list"),
])
def test_bad_return_values(body, needle):
    r = _reward(f"def reward(prompt, completion, item):\n    {body}\n")
    try:
        with pytest.raises(RewardError, match=re.escape(needle)):
            score_all([r], _batch(), 2)
    finally:
        r.close()


def test_load_errors():
    r = _reward("x = 1\n")
    with pytest.raises(RewardError, match="no function named 'reward'"):
        r.score(_batch())
    r = _reward("import nonexistent_module_xyz\n")
    with pytest.raises(RewardError, match="could not be loaded: ModuleNotFoundError"):
        r.score(_batch())


def test_sandbox_has_no_worker_environment(monkeypatch):
    monkeypatch.setenv("WHETSTONE_DATABASE_URL", "postgresql://secret")
    r = _reward("import os\n"
                "def reward(prompt, completion, item):\n"
                "    return float(any(k.startswith('WHETSTONE') for k in os.environ))\n")
    try:
        assert r.score(_batch(2)) == [0.0, 0.0]
    finally:
        r.close()
