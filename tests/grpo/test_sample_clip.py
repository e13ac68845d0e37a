"""Issue 19 (Low): the GRPO samples' prompt and completion are cut at a word boundary and
marked with an ellipsis, never mid-word."""
from __future__ import annotations

from worker.engine.grpo import clip_end, clip_start

PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately "
          "completes the request.\n\n### Instruction:\nHow many clips did Natalia sell?\n\n"
          "### Response:\n")


def test_prompt_cut_from_the_left_at_a_word_with_an_ellipsis():
    out = clip_start(PROMPT, 60)
    assert out.startswith("…") and len(out) <= 60
    assert PROMPT.endswith(out[1:])
    first_word = out[1:].split()[0]
    assert f" {first_word}" in PROMPT or f"\n{first_word}" in PROMPT  # a whole word
    assert clip_start("short prompt", 60) == "short prompt"


def test_completion_cut_at_a_word_with_an_ellipsis():
    text = "Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips altogether."
    out = clip_end(text, 40)
    assert out == "Natalia sold 48/2 = 24 clips in May.…"
    assert clip_end("x" * 50, 20) == "x" * 19 + "…"
    assert clip_end(text, 400) == text
