"""The greedy comparison accepts a divergence only at a near tie of the reference's logits."""
from worker.export.verify import NEAR_TIE, compare_greedy


def ref(tops):
    return {"prompt": "p", "continuation": [5, 6, 7], "top": tops}


TOPS = [[[5, 10.0], [9, 1.0]], [[6, 12.0], [8, 11.99], [9, 3.0]], [[7, 9.0], [1, 2.0]]]


def test_identical_sequences_pass():
    assert compare_greedy("greedy", ref(TOPS), [5, 6, 7], "bfloat16") == (None, None)


def test_divergence_at_a_near_tie_is_reported_not_failed():
    fail, tie = compare_greedy("greedy", ref(TOPS), [5, 8, 3], "bfloat16")
    assert fail is None
    assert tie["position"] == 1 and abs(tie["margin"] - 0.01) < 1e-6
    assert abs(tie["limit"] - NEAR_TIE["bfloat16"] * 12.0) < 1e-6


def test_same_divergence_fails_at_fp32_precision():
    fail, tie = compare_greedy("greedy", ref(TOPS), [5, 8, 3], "float32")
    assert tie is None and fail["first_mismatch"] == 1 and fail["got_tokens"] == [5, 8, 3]


def test_divergence_with_a_clear_margin_fails():
    fail, tie = compare_greedy("greedy", ref(TOPS), [9, 6, 7], "bfloat16")
    assert tie is None and fail["first_mismatch"] == 0


def test_token_outside_the_reference_top_k_uses_the_floor_and_fails():
    fail, _ = compare_greedy("greedy", ref(TOPS), [5, 6, 400], "bfloat16")
    assert fail["first_mismatch"] == 2


def test_shorter_artifact_sequence_fails():
    fail, _ = compare_greedy("greedy", ref(TOPS), [5, 6], "bfloat16")
    assert fail["first_mismatch"] == 2
