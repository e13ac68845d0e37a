"""Paths to the real test data in ../shared/data (importable from the tests of tests/data)."""
from __future__ import annotations

import os
from pathlib import Path

SHARED = Path(os.environ.get("WHETSTONE_SEED_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")
GPT2 = SHARED / "tokenizers" / "gpt2-bpe"
TEMPLATES_DIR = SHARED / "chat_templates"
# Marker strings of the real templates: in the real models these are added (special)
# tokens, so we register them on the GPT-2 test tokenizer the same way.
TEMPLATE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>",
                     "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "[INST]", "[/INST]",
                     "<s>", "</s>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")


def template_files() -> list[Path]:
    return sorted(TEMPLATES_DIR.glob("*.jinja"))


# (path under shared/data, detected format, rows, valid rows) — counts from shared/data/README.md
EXPECTED_ROWS = [
    ("sft/alpaca_en_demo.json", "alpaca", 999, 999),
    ("sft/identity_alpaca.json", "alpaca", 91, 91),
    ("sft/glaive_toolcall_en_demo_sharegpt.json", "sharegpt", 300, 300),
    ("sft/oasst1_en_100_alpaca.json", "alpaca", 95, 95),
    ("sft/oasst1_en_100_messages.jsonl", "messages", 95, 95),
    ("sft/oasst1_en_100_sharegpt.json", "sharegpt", 95, 95),
    ("sft/oasst1_en_100_trees.jsonl", "oasst_tree", 100, 95),  # 5 synthetic trees rejected
    ("sft/oasst_conversation_sharegpt.json", "sharegpt", 1, 1),
    ("messy/dolly_pretemplated_eos_marker.jsonl", "prompt_completion", 151, 151),
    ("pretrain_text/wiki_demo.txt", "text", 30, 30),
]
