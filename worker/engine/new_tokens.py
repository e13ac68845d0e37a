"""Give a base model the chat template's special tokens it lacks (as Unsloth and LLaMA-Factory do).

A base model's tokenizer often has no ``<|im_start|>``/``<|im_end|>`` (ChatML) or
``<start_of_turn>``/``<end_of_turn>``: the template's markers are then spelled as several plain
tokens, and the end of a turn is no single token an engine can stop on. :func:`add_tokens` adds
them to the tokenizer as special tokens and appends embedding rows (tied head rows with them),
each started at the mean of the existing rows; :func:`trainable_token_indices` is PEFT's
``LoraConfig(trainable_token_indices=...)`` that trains exactly those rows beside the LoRA
matrices, and the adapter stores them (``trainable_tokens_delta``). The tokenizer saved with the
adapter holds the new tokens; an export rebuilds the base at that vocabulary size
(:func:`resize_to_tokenizer`) before loading the adapter, so merged, GGUF and Ollama exports
carry the new vocabulary.
"""
from __future__ import annotations

import re

#: What a chat template's marker looks like: ``<|im_start|>``, DeepSeek's ``<｜User｜>`` (full-width
#: bars), ``<start_of_turn>``, ``[INST]``; not ``<think>`` (text the model writes, not a marker).
MARKER = re.compile(r"<[|｜][^|｜<>\s]{1,40}[|｜]>|<[a-z]+(?:_[a-z0-9]+)+>|\[/?[A-Z][A-Z_]{2,20}\]")
_SAMPLE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
           {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]


def _known(tok, text: str) -> bool:
    tid = tok.convert_tokens_to_ids(text)
    return tid is not None and tid != tok.unk_token_id and text in tok.get_vocab()


def missing_template_tokens(tok, template: str) -> list[str]:
    """The markers (:data:`MARKER`) of ``template``'s rendering of a sample conversation that
    ``tok`` has no single token for, in order of appearance (``[]`` when it has them all)."""
    from app.data.chat_template import render_chat

    try:
        text = render_chat(_SAMPLE, template, bos_token=tok.bos_token or "",
                           eos_token=tok.eos_token or "", add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that needs no system turn, say
        text = render_chat(_SAMPLE[1:], template, bos_token=tok.bos_token or "",
                           eos_token=tok.eos_token or "", add_generation_prompt=True)
    found = dict.fromkeys(m.group(0) for m in MARKER.finditer(text))
    return [t for t in found if not _known(tok, t)]


def add_tokens(model, tok, tokens: list[str]) -> list[int]:
    """Add ``tokens`` (those ``tok`` lacks) to ``tok`` as special tokens and grow ``model``'s
    embedding (and a tied head) to ``len(tok)`` rows, new rows = the mean of the old ones.
    Returns the ids of the added tokens (``[]`` when none was missing)."""
    import torch

    new = [t for t in dict.fromkeys(tokens) if not _known(tok, t)]
    if not new:
        return []
    old = model.get_input_embeddings().weight.shape[0]
    tok.add_tokens(new, special_tokens=True)
    ids = [int(tok.convert_tokens_to_ids(t)) for t in new]
    if len(tok) > old:
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        with torch.no_grad():
            emb = model.get_input_embeddings().weight
            emb[old:] = emb[:old].mean(dim=0)
            head = model.get_output_embeddings()
            if head is not None and head.weight is not emb:
                head.weight[old:] = head.weight[:old].mean(dim=0)
    return ids


def trainable_token_indices(ids: list[int]) -> dict | None:
    """PEFT's ``LoraConfig.trainable_token_indices`` for the added ``ids`` (None: none)."""
    return {"embed_tokens": list(ids)} if ids else None


def resize_to_tokenizer(model, n_tokens: int) -> bool:
    """Grow ``model``'s embedding to ``n_tokens`` rows when the run's tokenizer has more tokens
    than the base has rows (tokens added by :func:`add_tokens`); the adapter then sets the new
    rows. Returns whether it grew."""
    if n_tokens <= model.get_input_embeddings().weight.shape[0]:
        return False
    model.resize_token_embeddings(n_tokens, mean_resizing=False)
    return True
