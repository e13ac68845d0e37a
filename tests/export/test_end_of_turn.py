"""The end-of-turn token of every real chat template is the marker that CLOSES a turn
(``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``...), never the turn-START marker, with real
tokenizers whose specials list the start marker first (see ``chat_models``)."""
from __future__ import annotations

import pytest

from tests.export.chat_models import FAMILIES, TEMPLATE_FAMILY, chat_tokenizer, template_text
from tests.export.conftest import need_data


@pytest.mark.parametrize("stem", sorted(TEMPLATE_FAMILY))
def test_end_of_turn_is_the_closing_marker(stem):
    need_data()
    from worker.export.merged import chat_layout, end_of_turn_tokens

    family = TEMPLATE_FAMILY[stem]
    want = FAMILIES[family][3]
    tok = chat_tokenizer(family, template_text(stem))
    assert end_of_turn_tokens(tok, tok.chat_template) == [(want, tok.convert_tokens_to_ids(want))]
    lay = chat_layout(tok, tok.chat_template)
    assert lay.end_of_turn == [want] and lay.stops[0] == want
    assert lay.asst_post.startswith(want) and want not in lay.user_pre + lay.asst_pre
