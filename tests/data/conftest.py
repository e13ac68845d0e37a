"""Shared fixtures for the dataset-layer tests: real files from ../shared/data."""
from __future__ import annotations

import pytest
from datalayer_paths import GPT2, SHARED, TEMPLATE_SPECIALS

from app.data.encode import TokenizerBundle, byte_level_bpe

if not SHARED.is_dir():
    pytest.skip(f"shared data not found at {SHARED}", allow_module_level=True)


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    """The plain GPT-2 byte-level BPE (50,257 tokens, only <|endoftext|> special)."""
    return byte_level_bpe(GPT2 / "gpt2_vocab.json", GPT2 / "gpt2_merges.txt")


@pytest.fixture(scope="session")
def chat_tokenizer():
    """GPT-2 BPE plus the chat templates' marker strings as special tokens."""
    tok = byte_level_bpe(GPT2 / "gpt2_vocab.json", GPT2 / "gpt2_merges.txt")
    tok.add_special_tokens(list(TEMPLATE_SPECIALS))
    return tok


@pytest.fixture(scope="session")
def bundle(gpt2_tokenizer):
    return TokenizerBundle(gpt2_tokenizer, None, "<|endoftext|>", "<|endoftext|>")

