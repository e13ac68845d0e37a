"""The report's cheap per-row measure (``iter_rows(measure_only=True)``: token count,
truncation, trained or not, without the ids) equals what training gets from the full encoding
(``iter_rows``'s :class:`Encoded`), row by row, on the real files of ../shared/data, across
``max_seq_length`` (none, cutting every answer, cutting some) and ``train_on_responses_only``."""
from __future__ import annotations

import pytest
from datalayer_paths import EXPECTED_ROWS, SHARED

from app.data.chat_template import choose_template
from app.data.encode import TokenizerBundle
from app.data.report import iter_rows

FILES = [p for p, *_ in EXPECTED_ROWS] + ["messy/dolly_pretemplated_eos_marker.jsonl"]


@pytest.mark.parametrize("rel", sorted(set(FILES)))
def test_measure_equals_the_training_encoding(rel, chat_tokenizer):
    bundle = TokenizerBundle(chat_tokenizer, None, "<|endoftext|>", "<|endoftext|>",
                             {"eos_token": "<|endoftext|>"})
    template = choose_template(None, None)[1]
    rows = untrained = truncated = 0
    for max_len in (None, 8, 64, 256):
        for responses_only in (True, False):
            _, full = iter_rows(SHARED / rel, bundle, template, max_len, responses_only)
            _, cheap = iter_rows(SHARED / rel, bundle, template, max_len, responses_only,
                                 measure_only=True)
            for f, c in zip(full, cheap, strict=True):
                assert (f.row, f.error) == (c.row, c.error)
                if f.encoded is None:
                    continue
                e, m = f.encoded, c.encoded
                assert (m.num_tokens, m.truncated, m.trained) == \
                    (e.num_tokens, e.truncated, e.num_trained > 0), (rel, f.row, max_len)
                rows += 1
                untrained += not m.trained
                truncated += m.truncated
    assert rows > 0 and truncated > 0  # the cut and the uncut paths both ran
    if max(n for p, _, _, n in EXPECTED_ROWS if p == rel) > 30:
        assert untrained > 0  # so did the full fallback (answers past max_seq_length 8)
