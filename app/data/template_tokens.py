"""Which of a chat template's special markers a tokenizer has no single token for (torch-free).

A base model's tokenizer often lacks ``<|im_start|>``/``<|im_end|>`` (ChatML) or
``<start_of_turn>``/``<end_of_turn>``: the template's markers are then spelled as several plain
tokens and the end of a turn is no token an engine can stop on. The run form shows these
markers (the ``add_template_tokens`` option adds them, :mod:`worker.engine.new_tokens`); the
worker uses the same rule on the HF tokenizer it trains with.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from functools import lru_cache

#: What a chat template's marker looks like: ``<|im_start|>``, DeepSeek's ``<｜User｜>`` (full-width
#: bars), ``<start_of_turn>``, ``[INST]``; not ``<think>`` (text the model writes, not a marker).
MARKER = re.compile(r"<[|｜][^|｜<>\s]{1,40}[|｜]>|<[a-z]+(?:_[a-z0-9]+)+>|\[/?[A-Z][A-Z_]{2,20}\]")
_SAMPLE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
           {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]


def missing_markers(template: str, has_token: Callable[[str], bool], bos_token: str = "",
                    eos_token: str = "") -> list[str]:
    """The markers (:data:`MARKER`) of ``template``'s rendering of a sample conversation for
    which ``has_token(text)`` is False, in order of appearance (``[]``: none missing).

    Raises DatasetError when the template cannot render the sample (with or without a system
    turn)."""
    from app.data.chat_template import render_chat

    kw = dict(bos_token=bos_token or "", eos_token=eos_token or "", add_generation_prompt=True)
    try:
        text = render_chat(_SAMPLE, template, **kw)
    except Exception:  # noqa: BLE001 - a template that takes no system turn, say
        text = render_chat(_SAMPLE[1:], template, **kw)
    found = dict.fromkeys(m.group(0) for m in MARKER.finditer(text))
    return [t for t in found if not has_token(t)]


def missing_for_model(model_dir: str | os.PathLike, template: str) -> list[str] | None:
    """The markers of ``template`` the tokenizer files in ``model_dir`` lack (reads them with
    ``tokenizers``, no torch; cached per folder, its tokenizer.json's mtime and template).
    None when the tokenizer cannot be read or the template cannot render."""
    tj = os.path.join(str(model_dir), "tokenizer.json")
    mtime = os.path.getmtime(tj) if os.path.isfile(tj) else 0.0
    found = _cached(str(model_dir), mtime, template)
    return None if found is None else list(found)


@lru_cache(maxsize=32)
def _cached(model_dir: str, _mtime: float, template: str) -> tuple[str, ...] | None:
    from app.data.encode import load_tokenizer_bundle

    try:
        b = load_tokenizer_bundle(model_dir)
        vocab = b.tokenizer.get_vocab(with_added_tokens=True)
        return tuple(missing_markers(template, vocab.__contains__, b.bos_token or "",
                                     b.eos_token or ""))
    except Exception:  # noqa: BLE001 - a preview: no answer rather than an error
        return None
