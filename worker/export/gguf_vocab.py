"""Tokenizer metadata for GGUF (llama.cpp ``tokenizer.ggml.*`` keys, GGUF spec v3).

Two tokenizer models are written:

* ``llama`` (SentencePiece): ``tokens`` (pieces, ``▁`` for space), ``scores`` (float32; llama.cpp
  merges the adjacent pair whose concatenation has the highest score), ``token_type``
  (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), ``add_space_prefix``.
  Source: ``tokenizer.model`` through ``sentencepiece`` (exact scores) or, for a
  ``tokenizer.json`` BPE with ``byte_fallback`` (a converted SentencePiece model such as
  stories260K's), scores derived from the merge ranks: the result of merge *r* scores ``-r``,
  so llama.cpp merges in the same order as the HF tokenizer.
* ``gpt2`` (byte-level BPE): ``tokens``, ``token_type``, ``merges`` ("a b" strings) and the
  pre-tokenizer name ``tokenizer.ggml.pre`` that selects llama.cpp's split regex (``llama-bpe``
  for Llama 3, ``qwen2`` for Qwen2/3, ``gpt-2`` otherwise).

Special ids: bos, eos, unknown, padding, eot (the chat template's end-of-turn token when it is
not EOS); ``add_bos_token``/``add_eos_token``; ``tokenizer.chat_template``.

The unknown token is the tokenizer *model's* own (``tokenizer.json`` ``model.unk_token``, or the
SentencePiece unk), never a Python tokenizer class's default: transformers 5's ``Qwen2Tokenizer``
and ``GPT2Tokenizer`` report ``unk_token = "<|endoftext|>"`` for a byte-level BPE that has no
unknown token, which typed ``<|endoftext|>`` "unknown" (llama.cpp then warns about a
control-looking token that is not control). Every special added token is ``CONTROL``.
"""
from __future__ import annotations

import json
from pathlib import Path

from .files import ExportError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _byte_piece(p: str) -> bool:
    return len(p) == 6 and p.startswith("<0x") and p.endswith(">")


def _from_sentencepiece(path: Path):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i)
                     else UNUSED if sp.is_unused(i) else BYTE if sp.is_byte(i) else NORMAL)
    prefix = sp.encode("a", out_type=str)[:1] == ["\u2581a"]  # add_dummy_prefix, no protobuf
    return tokens, scores, types, prefix


def vocab_from_sentencepiece(path: Path) -> dict:
    """GGUF tokenizer fields straight from a ``tokenizer.model`` (ids from the model itself)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    tokens, scores, types, prefix = _from_sentencepiece(path)
    ids = {k: (v if v >= 0 else None) for k, v in (("bos", sp.bos_id()), ("eos", sp.eos_id()),
                                                   ("unk", sp.unk_id()), ("pad", sp.pad_id()))}
    return dict(model="llama", pre="default", add_space_prefix=prefix, tokens=tokens,
                scores=scores, types=types, add_bos=True, add_eos=False, **ids)


def vocab_from_tokenizer(tok, tokenizer_dir: Path | None, arch: str, vocab_size: int) -> dict:
    """Collect the GGUF tokenizer fields from a HF tokenizer (and its folder)."""
    data = json.loads(tok.backend_tokenizer.to_str()) if hasattr(tok, "backend_tokenizer") else {}
    model = data.get("model", {})
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    spm_file = tokenizer_dir / "tokenizer.model" if tokenizer_dir else None
    out: dict = {}
    if spm_file is not None and spm_file.exists():
        tokens, scores, types, prefix = _from_sentencepiece(spm_file)
        out.update(model="llama", pre="default", add_space_prefix=prefix)
    elif model.get("type") == "BPE" and model.get("byte_fallback"):
        vocab = model["vocab"]
        tokens = [None] * len(vocab)
        for piece, i in vocab.items():
            tokens[i] = piece
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        rank = {}
        for r, m in enumerate(merges):
            rank.setdefault(m.replace(" ", "", 1), r)
        floor = -float(len(merges) + 1)
        scores = [float(-rank[p]) if p in rank else floor for p in tokens]
        types = [BYTE if _byte_piece(p) else NORMAL for p in tokens]
        norm = json.dumps(data.get("normalizer") or {}, ensure_ascii=False)
        out.update(model="llama", pre="default",
                   add_space_prefix='"Prepend"' in norm and "\u2581" in norm)
    elif model.get("type") == "BPE":
        vocab = model["vocab"]
        tokens = [None] * len(vocab)
        for piece, i in vocab.items():
            tokens[i] = piece
        scores = None
        types = [NORMAL] * len(tokens)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        pre = {"qwen2": "qwen2", "qwen3": "qwen2"}.get(arch)
        if pre is None:
            pre = "llama-bpe" if "<|begin_of_text|>" in tok.get_vocab() else "gpt-2"
        out.update(model="gpt2", pre=pre, merges=merges)
    else:
        raise ExportError(f"tokenizer model {model.get('type')!r} is not supported for GGUF "
                          "(SentencePiece or BPE only)")
    # Added tokens (specials -> control, others -> user-defined), then padding to vocab_size.
    for i, t in sorted(added.items()):
        while i >= len(tokens):
            tokens.append(f"[PAD{len(tokens)}]")
            types.append(UNUSED)
            if scores is not None:
                scores.append(-1000.0)
        tokens[i] = t["content"]
        if types[i] != UNKNOWN and not (types[i] == BYTE and _byte_piece(t["content"])):
            types[i] = CONTROL if t.get("special") else USER_DEFINED
    unk = _model_unk(tok, model, spm_file)
    if unk is not None and unk < len(types) and types[unk] != CONTROL:
        types[unk] = UNKNOWN
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
        if scores is not None:
            scores.append(-1000.0)
    if len(tokens) > vocab_size:
        raise ExportError(f"tokenizer has {len(tokens)} tokens but the model only {vocab_size}")
    probe = tok("a", add_special_tokens=True)["input_ids"]  # what the tokenizer really does
    add_bos = tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id]
    out.update(tokens=tokens, scores=scores, types=types, bos=tok.bos_token_id,
               eos=tok.eos_token_id, unk=unk, pad=tok.pad_token_id, add_bos=bool(add_bos),
               add_eos=tok.eos_token_id is not None and probe[-1:] == [tok.eos_token_id])
    return out


def _model_unk(tok, model: dict, spm_file: Path | None) -> int | None:
    """The id of the tokenizer model's own unknown token (None for byte-level BPE)."""
    if spm_file is not None and spm_file.exists():
        import sentencepiece as spm

        i = spm.SentencePieceProcessor(model_file=str(spm_file)).unk_id()
        return i if i >= 0 else None
    text = model.get("unk_token")
    return tok.convert_tokens_to_ids(text) if text and text in tok.get_vocab() else None


def write_vocab(w, v: dict, chat_template: str | None = None, eot_id: int | None = None) -> None:
    """Add the ``tokenizer.ggml.*`` keys of :func:`vocab_from_tokenizer`'s result to writer ``w``."""
    w.add_tokenizer_model(v["model"])
    w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    if v.get("scores") is not None:
        w.add_token_scores(v["scores"])
    w.add_token_types(v["types"])
    if v.get("merges"):
        w.add_token_merges(v["merges"])
    if v["model"] == "llama":
        w.add_add_space_prefix(bool(v.get("add_space_prefix", True)))
    for key, fn in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                    ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):
        if v.get(key) is not None:
            fn(int(v[key]))
    if eot_id is not None:
        w.add_eot_token_id(int(eot_id))
    w.add_add_bos_token(v["add_bos"])
    w.add_add_eos_token(v["add_eos"])
    if chat_template:
        w.add_chat_template(chat_template)
