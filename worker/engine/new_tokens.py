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

from app.data.template_tokens import MARKER, missing_markers  # noqa: F401 - MARKER re-exported


def _known(tok, text: str) -> bool:
    tid = tok.convert_tokens_to_ids(text)
    return tid is not None and tid != tok.unk_token_id and text in tok.get_vocab()


def missing_template_tokens(tok, template: str) -> list[str]:
    """The markers (:data:`MARKER`) of ``template``'s rendering of a sample conversation that
    ``tok`` has no single token for, in order of appearance (``[]`` when it has them all)."""
    return missing_markers(template, lambda t: _known(tok, t), tok.bos_token or "",
                           tok.eos_token or "")


def extend_tokenizer(tok, tokens: list[str]) -> list[int]:
    """Add ``tokens`` (those ``tok`` lacks) to ``tok`` as special tokens; their ids (``[]``
    when none was missing). The model then needs :func:`grow_embeddings` to ``len(tok)``."""
    new = [t for t in dict.fromkeys(tokens) if not _known(tok, t)]
    if not new:
        return []
    tok.add_tokens(new, special_tokens=True)
    return [int(tok.convert_tokens_to_ids(t)) for t in new]


def grow_embeddings(model, n_tokens: int) -> bool:
    """Grow ``model``'s embedding (and a tied or untied head) to ``n_tokens`` rows, the new rows
    started at the mean of the old ones. Returns whether it grew."""
    import torch

    old = model.get_input_embeddings().weight.shape[0]
    if n_tokens <= old:
        return False
    model.resize_token_embeddings(n_tokens, mean_resizing=False)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[old:] = emb[:old].mean(dim=0)
        head = model.get_output_embeddings()
        if head is not None and head.weight is not emb:
            head.weight[old:] = head.weight[:old].mean(dim=0)
    return True


def add_tokens(model, tok, tokens: list[str]) -> list[int]:
    """Add ``tokens`` (those ``tok`` lacks) to ``tok`` as special tokens and grow ``model``'s
    embedding (and a tied head) to ``len(tok)`` rows, new rows = the mean of the old ones.
    Returns the ids of the added tokens (``[]`` when none was missing)."""
    ids = extend_tokenizer(tok, tokens)
    if ids:
        grow_embeddings(model, len(tok))
    return ids


def trainable_token_indices(ids: list[int], model=None) -> dict | None:
    """PEFT's ``LoraConfig.trainable_token_indices`` for the added ``ids`` (None: none): the
    input embedding's module name -> ``ids`` (``embed_tokens`` without ``model``), and an untied
    output head's name -> ``ids`` too (a tied head follows the embedding in PEFT)."""
    if not ids:
        return None
    if model is None:
        return {"embed_tokens": list(ids)}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    out = {names.get(id(emb), "embed_tokens"): list(ids)}
    if head is not None and head.weight is not emb.weight and id(head) in names:
        out[names[id(head)]] = list(ids)
    return out


def resize_to_tokenizer(model, n_tokens: int) -> bool:
    """Grow ``model``'s embedding to ``n_tokens`` rows when the run's tokenizer has more tokens
    than the base has rows (tokens added by :func:`add_tokens`); the adapter then sets the new
    rows. Returns whether it grew."""
    if n_tokens <= model.get_input_embeddings().weight.shape[0]:
        return False
    model.resize_token_embeddings(n_tokens, mean_resizing=False)
    return True
