"""Advantages, reward validation and the built-in rewards (on real GSM8K rows)."""
from __future__ import annotations

import math
from decimal import Decimal

import pytest
from pydantic import ValidationError

from app.data import answers
from app.store.specs import GrpoSpec, RewardSpec
from worker.rewards import builtin
from worker.rewards.base import (Batch, PerSample, RewardError, RewardFunction, group_advantages,
                                 score_all, validate)
from worker.rewards.registry import build


# ---- advantages --------------------------------------------------------------------------
def test_advantages_one_right_of_four():
    adv, zero = group_advantages([1, 0, 0, 0], 4, "group")
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-12)
    assert zero == 0


def test_all_equal_group_gives_zeros_and_is_counted():
    adv, zero = group_advantages([0.3, 0.3, 0.3, 0.3, 1, 0, 0, 0], 4, "group")
    assert adv[:4] == [0.0, 0.0, 0.0, 0.0]
    assert adv[4:] == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert zero == 1
    for scale in ("batch", "none"):
        adv, zero = group_advantages([2, 2, 2, 2], 4, scale)
        assert adv == [0.0] * 4 and zero == 1


def test_advantage_scales():
    adv, _ = group_advantages([1, 0, 0, 0], 4, "none")
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25])
    adv, _ = group_advantages([1, 0, 0, 0, 5, 5, 5, 5], 4, "batch")
    rs = [1, 0, 0, 0, 5, 5, 5, 5]
    m = sum(rs) / 8
    s = math.sqrt(sum((r - m) ** 2 for r in rs) / 7)
    assert adv[:4] == pytest.approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])
    assert adv[4:] == [0.0] * 4


def test_advantages_reject_partial_groups_and_nan():
    with pytest.raises(ValueError):
        group_advantages([1, 0, 0], 2)
    with pytest.raises(ValueError):
        group_advantages([1, float("nan")], 2)


# ---- validation: every way a reward can be wrong stops the run -----------------------------
def _batch(n=4):
    return Batch([f"prompt {i}" for i in range(n)], [f"completion {i}" for i in range(n)],
                 [3] * n, {"answer": [f"#### {i}" for i in range(n)]})


class _Fixed(RewardFunction):
    def __init__(self, values, name="fixed"):
        self.values, self.name = values, name

    def score(self, batch):
        return self.values


@pytest.mark.parametrize("values, needle, index", [
    ([1.0, None, 0.0, 0.0], "returned None", 1),
    ([1.0, 0.0, "yes", 0.0], "returned a str ('yes'), not a number", 2),
    ([1.0, 0.0, 0.0, float("nan")], "returned nan, not a finite number", 3),
    ([float("inf"), 0.0, 0.0, 0.0], "returned inf", 0),
    ([1.0, 0.0, [1.0], 0.0], "returned a list", 2),
])
def test_bad_values_name_function_and_sample(values, needle, index):
    with pytest.raises(RewardError) as ei:
        validate("my_reward", values, _batch())
    msg = str(ei.value)
    assert "'my_reward'" in msg and needle in msg
    assert f"offending sample #{index}" in msg and f"completion {index}" in msg


def test_wrong_count_is_never_broadcast():
    with pytest.raises(RewardError, match=r"returned 1 rewards for 4 completions"):
        validate("scalar", [1.0], _batch())
    with pytest.raises(RewardError, match=r"returned a float, not a list of 4"):
        validate("scalar", 1.0, _batch())
    with pytest.raises(RewardError, match="returned 5 rewards"):
        score_all([_Fixed([0.0] * 5)], _batch(), 4)


def test_raising_reward_names_the_sample():
    def fn(s):
        if s.index == 2:
            raise ZeroDivisionError("division by zero")
        return 1.0

    with pytest.raises(RewardError) as ei:
        score_all([PerSample("divider", fn)], _batch(), 4)
    assert "'divider' raised ZeroDivisionError: division by zero" in str(ei.value)
    assert "#2" in str(ei.value) and "completion 2" in str(ei.value)


def test_numbers_of_other_types_are_accepted():
    import numpy as np

    assert validate("n", [True, 1, np.float32(0.5), np.int64(2)], _batch()) == [1.0, 1.0, 0.5, 2.0]


def test_score_all_weights_and_reports():
    b = _batch(8)
    a = _Fixed([1, 0, 0, 0, 1, 1, 1, 1], "a")
    c = _Fixed([0, 0, 0, 0, 0, 0, 0, 0], "c")
    c.weight = 2.0
    s = score_all([a, c], b, 4)
    assert s.total == [1, 0, 0, 0, 1, 1, 1, 1]
    assert s.advantages[:4] == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert s.frac_zero_std == 0.5 and s.names == ["a", "c"]


# ---- built-ins on real GSM8K rows ---------------------------------------------------------
def test_gsm8k_references_parse(gsm8k_rows):
    for row in gsm8k_rows:
        ref = answers.reference_answer(row["answer"])
        assert ref is not None, row["answer"]
        assert str(ref) == row["answer"].split("####")[-1].strip().replace(",", "")


def test_numeric_match_on_gsm8k(gsm8k_rows):
    fn = builtin.make_builtin("numeric_match", {}, "answer")
    rows = gsm8k_rows[:8]
    refs = [r["answer"].split("####")[-1].strip() for r in rows]
    comps = []
    for i, ref in enumerate(refs):
        comps.append([f"So the answer is \\boxed{{{ref}}}.",  # right, boxed
                      f"Step by step... #### {ref}",  # right, GSM8K style
                      f"<think>work</think><answer>{ref}</answer>",  # right, tag
                      f"I think it is {int(Decimal(ref.replace(',', ''))) + 1}",  # wrong
                      ][i % 4])
    b = Batch([r["question"] for r in rows], comps, [10] * 8,
              {"answer": [r["answer"] for r in rows], "question": [r["question"] for r in rows]})
    got = validate(fn.name, fn.score(b), b)
    assert got == [1, 1, 1, 0, 1, 1, 1, 0]
    # the GSM8K solution text itself scores 1 against its own reference
    b2 = Batch([""] * 8, [r["answer"] for r in rows], [1] * 8, {"answer": [r["answer"] for r in rows]})
    assert fn.score(b2) == [1.0] * 8


def test_numeric_extraction_forms():
    ex = answers.extract_answer
    assert ex("\\boxed{\\frac{7}{2}}") == Decimal("3.5")
    assert ex("total $1,234.50.") == Decimal("1234.50")
    assert ex("#### 72") == 72 and ex("first 3 then \\boxed{5} then 9") == 5
    assert ex("no digits", strict=False) is None
    assert ex("the answer is 12", strict=True) is None
    strict = builtin.make_builtin("numeric_match", {"strict": True}, "answer")
    b = Batch(["q"], ["it is 72"], [3], {"answer": ["#### 72"]})
    assert strict.score(b) == [0.0]


def test_exact_regex_format_length():
    b = Batch(["p"] * 4, ["  Paris ", "paris.", "<think>x</think> <answer>4</answer>",
                          "blah <think>x</think> and <answer>4</answer>"],
              [2, 2, 20, 40], {"city": ["paris"] * 4, "n": ["4"] * 4})
    assert builtin.make_builtin("exact_match", {"column": "city"}, None).score(b)[:2] == [1.0, 0.0]
    rx = builtin.make_builtin("regex_match", {"pattern": r"<answer>(\d+)</answer>",
                                              "column": "n"}, None)
    assert rx.score(b) == [0.0, 0.0, 1.0, 1.0]
    word = builtin.make_builtin("regex_match", {"pattern": r"(?i)\bparis\b"}, None)
    assert word.score(b) == [1.0, 1.0, 0.0, 0.0]
    assert builtin.make_builtin("format", {}, None).score(b) == [0.0, 0.0, 1.0, 0.5]
    assert builtin.make_builtin("length_penalty", {"target_tokens": 20}, None).score(b) == \
        [0.0, 0.0, 0.0, -1.0]


def test_a_backtracking_pattern_stops_the_run_in_a_second_not_hours():
    """Trial s22 F12: a member's ``(\\s*\\w+\\s*)*\\d`` held the training process in C code
    (no heartbeat, no cancel) on ordinary story text. Patterns are matched by the ``regex``
    library (that one is answered at once there) with a time limit per search; a pattern that
    still backtracks past it fails the reward, naming the pattern."""
    import time

    story = "Once upon a time there was a little girl named Lily who loved to play " * 3
    b = Batch(["p"], [story], [len(story)], {})
    t = time.monotonic()
    trial = builtin.make_builtin("regex_match", {"pattern": r"(\s*\w+\s*)*\d"}, None)
    assert trial.score(b) == [0.0] and time.monotonic() - t < 1
    bad = builtin.make_builtin("regex_match", {"pattern": r"(\w+\s*){1,50}\d"}, None)
    t = time.monotonic()
    with pytest.raises(RewardError, match=r"took more than 1 s on one completion of 210 "
                                          r"characters: it backtracks without bound"):
        bad.score(b)
    assert time.monotonic() - t < 5
    assert builtin.make_builtin("regex_match", {"pattern": r"\bLily\b"}, None).score(b) == [1.0]


def test_missing_column_is_a_clear_error():
    fn = builtin.make_builtin("exact_match", {"column": "nope"}, None)
    with pytest.raises(RewardError, match="no column 'nope'"):
        fn.score(_batch())


def test_spec_validation_and_registry():
    spec = GrpoSpec(model="m", dataset="d", rewards=[
        {"name": "numeric_match"}, {"name": "format", "weight": 0.5},
        {"name": "format", "weight": 0.1}])
    fns = build(spec, "answer")
    assert [f.name for f in fns] == ["numeric_match", "format", "format_2"]
    assert [f.weight for f in fns] == [1.0, 0.5, 0.1]
    with pytest.raises(ValidationError, match="multiple of num_generations"):
        GrpoSpec(model="m", dataset="d", rewards=[{"name": "format"}], num_generations=3)
    with pytest.raises(ValidationError, match="unknown reward"):
        RewardSpec(name="vibes")
    with pytest.raises(ValidationError, match="line 1"):
        RewardSpec(name="custom", params={"source": "def reward(:"})
    with pytest.raises(ValidationError, match="target_tokens"):
        RewardSpec(name="length_penalty")
    for field in ("temperature", "learning_rate", "beta"):  # NaN/inf: "finite", not a range
        with pytest.raises(ValidationError, match=f"{field}\n  Input should be a finite number"):
            GrpoSpec(model="m", dataset="d", rewards=[{"name": "format"}], **{field: float("nan")})


def test_contains_negate_and_similarity():
    b = Batch(["p"] * 3, ["The answer is 72.", "72", "seventy"], [1] * 3, {"answer": ["72"] * 3})
    assert builtin.make_builtin("exact_match", {"contains": True}, "answer").score(b) == [1, 1, 0]
    assert builtin.make_builtin("exact_match", {"negate": True}, "answer").score(b) == [1, 0, 1]
    sim = builtin.make_builtin("text_similarity", {}, "answer").score(b)
    assert sim[1] == 1.0 and 0 < sim[0] < 1 and sim[2] == 0.0
    assert builtin.make_builtin("text_similarity", {"pass_threshold": 0.5}, "answer").score(b) \
        == [0.0, 1.0, 0.0]


def test_prompt_datasets(tmp_path):
    from app.data.errors import DatasetError
    from app.data.prompts import inspect_prompts, pick_columns, prompt_messages

    assert pick_columns({"question": "q", "answer": "a"}) == ("question", "answer")
    assert pick_columns({"messages": [], "reference_answer": "4"}, None, "reference_answer") \
        == ("messages", "reference_answer")
    with pytest.raises(DatasetError, match="no prompt column"):
        pick_columns({"x": 1})
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    assert prompt_messages(msgs, "messages", "ignored") == msgs[:2]  # up to the last user turn
    assert prompt_messages("hi", "q", "sys") == [{"role": "system", "content": "sys"},
                                                 {"role": "user", "content": "hi"}]
    assert prompt_messages("  ", "q") is None
    p = tmp_path / "rft.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}\n'
                 '{"messages": [{"role": "assistant", "content": "no user"}], "answer": "1"}\n')
    rep = inspect_prompts(p)
    assert rep["rows"] == 2 and rep["valid_rows"] == 1 and rep["prompt_column"] == "messages"
    assert [(i["row"], i["field"]) for i in rep["invalid"]] == [(2, "messages")]
