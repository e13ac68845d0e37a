"""Merged 16-bit export: base + LoRA delta as one ``LlamaForCausalLM``-style safetensors folder.

* QLoRA runs trained against an NF4-quantised base, so the merge starts from the base *as the
  adapter saw it*: each quantised ``nn.Linear`` weight is dequantised from NF4 (bitsandbytes'
  ``dequantize_4bit`` when the model holds ``Params4bit``; otherwise the NF4 round trip of the
  16/32-bit weight, :func:`nf4_roundtrip`: blocks of 64, absmax scaling, the 16-value NF4 code
  book of Dettmers et al. 2023 "QLoRA", Appendix E). ``lm_head`` is never quantised (as in
  transformers' bitsandbytes integration). Double quantisation of the absmax is not reproduced
  on CPU (its error is ~1e-3 of the scale).
* The delta ``B @ A * scaling`` is added with peft's ``merge_and_unload`` in fp32, then the
  weights are cast to the chosen dtype and saved with ``save_pretrained`` (safetensors). The
  default dtype is 16-bit, as the format's name promises (:func:`merged_dtype`): the base's own
  when it is bf16 or fp16 (``config.json`` ``dtype``/``torch_dtype``, else the dtype of the
  base's stored tensors), and bf16 for an fp32 base, the field's usual choice (Unsloth's
  ``save_method="merged_16bit"``, LLaMA-Factory's export dtype): fp32's exponent range, so no
  overflow, at 8 significant bits; a near tie between two tokens may then break the other way,
  which verification accepts and reports (:mod:`worker.export.verify`). ``fp32`` is written only
  when asked for. The result states the dtype, why (``dtype_reason``) and the rounding it
  implies (:data:`ROUNDING`); the model card says the same.
* Tied embeddings (:func:`merge_adapter`): PEFT computes a LoRA on ``embed_tokens`` of a tied
  model with the trained embedding on the input side only; the output head keeps the base
  matrix. Merging into the shared tensor would make the head the trained embedding too (a
  different model), so the head is given its own copy before the merge. When the merged
  embedding and head are still equal they are tied again (``lm_head`` not written); when they
  differ the export is untied: ``tie_word_embeddings=false`` and both matrices stored.
* The chat template's end-of-turn token (e.g. ``<|im_end|>``) is added to ``eos_token_id`` in
  config.json and generation_config.json and becomes ``eos_token`` of the tokenizer config,
  so ``generate`` and serving stacks stop at the end of the answer.
"""
from __future__ import annotations

import json
from pathlib import Path

from .files import ExportError, ProgressFn, atomic_path, noop_progress
from .run import RunInfo, load_tokenizer, load_trained_model

NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: What casting a weight to the dtype does to it (relative rounding of one value).
ROUNDING = {"bf16": "bfloat16 keeps 8 significant bits: each weight rounded by up to 2^-9 "
                    "(0.2%) of its value",
            "fp16": "float16 keeps 11 significant bits: each weight rounded by up to 2^-12 "
                    "(0.024%) of its value, beyond +-65504 it overflows",
            "fp32": "float32: the fp32 merge is stored without further rounding"}


#: safetensors' dtype names of the floating types an export dtype key stands for.
_STORED = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


def _stored_tensor_dtype(base_dir: Path) -> str | None:
    """The export dtype key of the first floating tensor in the base's safetensors, or None."""
    from safetensors import safe_open

    for path in sorted(Path(base_dir).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                found = _STORED.get(f.get_slice(key).get_dtype())
                if found:
                    return found
    return None


def base_dtype(base_dir: Path) -> str:
    """The base's stored dtype as an export dtype key (``bf16``/``fp16``/``fp32``), read from
    ``config.json`` (``dtype`` or ``torch_dtype``); when unset, the dtype of its first floating
    safetensors tensor; ``fp32`` when neither says, or for another type."""
    cfg_p = Path(base_dir) / "config.json"
    cfg = json.loads(cfg_p.read_text()) if cfg_p.is_file() else {}
    stored = cfg.get("dtype") or cfg.get("torch_dtype")
    if not stored:
        return _stored_tensor_dtype(base_dir) or "fp32"
    return {v: k for k, v in DTYPES.items()}.get(str(stored).removeprefix("torch."), "fp32")


def merged_dtype(base_dir: Path, requested: str | None = None) -> tuple[str, str]:
    """``(dtype key, why)`` the merged 16-bit export writes: ``requested`` when given (``bf16``,
    ``fp16`` or ``fp32``), else the base's own when 16-bit (:func:`base_dtype`), else ``bf16``
    (see the module docstring). ``why`` is one sentence for the log and the model card."""
    if requested:
        return requested, f"{requested} was requested"
    base = base_dtype(base_dir)
    if base in ("bf16", "fp16"):
        return base, f"the base model's weights are {base}"
    return "bf16", ("the base model's weights are fp32 and a merged 16-bit export is 16-bit: "
                    "bf16 keeps fp32's range (no overflow), as Unsloth's and LLaMA-Factory's "
                    "16-bit merges do")


def nf4_roundtrip(w, blocksize: int = 64):
    """Quantise ``w`` to NF4 (per-block absmax) and back; same shape and dtype as ``w``."""
    import torch

    flat = w.detach().float().reshape(-1)
    pad = (-flat.numel()) % blocksize
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, blocksize)
    absmax = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    code = torch.tensor(NF4_CODE)
    idx = (blocks / absmax).unsqueeze(-1).sub(code).abs().argmin(dim=-1)
    deq = (code[idx] * absmax).reshape(-1)[:flat.numel()]
    return deq.view_as(w).to(w.dtype)


def dequantized_base_(model) -> int:
    """Replace every quantisable Linear weight (not lm_head) by its NF4-dequantised value.

    Returns the number of weights changed. Uses bitsandbytes when the weight is a
    ``Params4bit`` (CUDA); otherwise the pure-PyTorch round trip.
    """
    import torch

    n = 0
    for name, mod in model.named_modules():
        if name.endswith("lm_head") or not hasattr(mod, "weight") or mod.weight is None:
            continue
        w = mod.weight
        if type(w).__name__ == "Params4bit":  # bitsandbytes, CUDA only
            import bitsandbytes.functional as bnbf

            deq = bnbf.dequantize_4bit(w.data, w.quant_state).to(torch.float32)
            new = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            new.weight = torch.nn.Parameter(deq, requires_grad=False)
            if mod.bias is not None:
                new.bias = mod.bias
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], new)
            n += 1
        elif isinstance(mod, torch.nn.Linear):
            with torch.no_grad():
                w.copy_(nf4_roundtrip(w))
            n += 1
    return n


def special_strings(tok) -> list[str]:
    """All special/added token strings of a tokenizer (for naming end-of-turn markers)."""
    out = list(dict.fromkeys([*tok.all_special_tokens,
                              *(t.content for t in tok.added_tokens_decoder.values())]))
    return [t for t in out if t]


def chat_layout(tok, template: str | None):
    """The :class:`~worker.export.chat.ChatLayout` of ``template`` for this tokenizer."""
    from .chat import derive_layout

    if not template:
        return None
    special = {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}
    return derive_layout(template, special, special_strings(tok))


def end_of_turn_tokens(tok, template: str | None) -> list[tuple[str, int]]:
    """``[(text, id)]`` of the template's end-of-turn marker when it is a single token of ``tok``
    (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``; never a turn-start marker); ``[]`` when
    there is no template or its end marker is plain text."""
    lay = chat_layout(tok, template)
    out = []
    for text in (lay.end_of_turn if lay else []):
        ids = tok.convert_tokens_to_ids([text])
        if ids and ids[0] is not None and ids[0] != tok.unk_token_id:
            out.append((text, int(ids[0])))
    return out


def _as_list(v) -> list[int]:
    return [] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]


def add_end_tokens(folder: Path, eot: list[tuple[str, int]]) -> list[int]:
    """Add end-of-turn ids to config.json / generation_config.json / tokenizer_config.json."""
    ids = [i for _, i in eot]
    cfg_p, gen_p, tok_p = (folder / "config.json", folder / "generation_config.json",
                           folder / "tokenizer_config.json")
    cfg = json.loads(cfg_p.read_text())
    ends = list(dict.fromkeys(_as_list(cfg.get("eos_token_id")) + ids))
    if ids:
        cfg["eos_token_id"] = ends if len(ends) > 1 else ends[0]
        cfg_p.write_text(json.dumps(cfg, indent=2))
    gen = json.loads(gen_p.read_text()) if gen_p.exists() else {}
    gen_ends = list(dict.fromkeys(_as_list(gen.get("eos_token_id")) + ends))
    gen["eos_token_id"] = gen_ends
    gen.setdefault("bos_token_id", cfg.get("bos_token_id"))
    gen_p.write_text(json.dumps(gen, indent=2))
    if eot and tok_p.exists():
        tcfg = json.loads(tok_p.read_text())
        tcfg["eos_token"] = eot[0][0]
        tok_p.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False))
    return gen_ends


def merge_adapter(model):
    """Merge a ``PeftModel`` (fp32) into its base, as PEFT computes base + adapter.

    Returns ``(merged model, untied: bool)``; ``untied`` is True when the model was tied but the
    trained embedding and the output head now differ (see the module docstring).
    """
    import torch

    config = model.get_base_model().config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    # give the head its own copy so a LoRA delta of the embedding is not merged into it; rows
    # trained with trainable_token_indices (added tokens) are PEFT's on both sides (the head is
    # then PEFT's TrainableTokensWrapper) and merge into the shared matrix as they should
    if tied and not hasattr(head, "token_adapter"):
        head = getattr(head, "base_layer", head)
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    merged = model.merge_and_unload()
    if not tied:
        return merged, False
    emb, out = merged.get_input_embeddings(), merged.get_output_embeddings()
    if emb.weight.shape == out.weight.shape and torch.equal(emb.weight, out.weight):
        out.weight = emb.weight  # tied again: one matrix, as the base model had it
        _set_tied(merged.config, True)  # peft's unload marks a model with a separate head untied
        return merged, False
    _set_tied(merged.config, False)
    return merged, True


def _set_tied(config, tied: bool) -> None:
    config.tie_word_embeddings = tied
    if getattr(config, "get_text_config", None):
        config.get_text_config().tie_word_embeddings = tied


def export_merged(info: RunInfo, out_dir: str | Path, dtype: str | None = None,
                  progress: ProgressFn = noop_progress, provenance: dict | None = None) -> dict:
    """Write ``out_dir`` (atomically) and return ``{"path", "dtype", "dtype_from",
    "dtype_reason", "rounding", "eos_token_id", ...}``; ``dtype_from``: ``requested``, ``base``
    (the base's own 16-bit dtype) or ``default`` (bf16 for an fp32 base).

    ``dtype``: ``bf16``/``fp16``/``fp32``, None for the default (:func:`merged_dtype`: the
    base's own when 16-bit, else bf16).
    ``provenance`` (:func:`worker.export.provenance.provenance`) goes into ``config.json``
    (``merged_from``) and the model card ``README.md``. Raises :class:`ExportError`."""
    import torch

    if dtype and dtype not in DTYPES:
        raise ExportError(f"merged dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    dtype_from = "requested" if dtype else None
    dtype, why = merged_dtype(info.base_dir, dtype)
    dtype_from = dtype_from or ("base" if base_dtype(info.base_dir) == dtype else "default")
    progress("load", 0.05)
    model = load_trained_model(info, dtype=torch.float32)
    tok = load_tokenizer(info)
    progress("merge", 0.4)
    merged, untied = merge_adapter(model)
    merged = merged.to(getattr(torch, DTYPES[dtype]))
    tied = bool(getattr(merged.config, "tie_word_embeddings", False))
    merged.config.dtype = DTYPES[dtype]
    eot = end_of_turn_tokens(tok, info.chat_template)
    progress("save", 0.6)
    with atomic_path(out_dir) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if info.chat_template:
            (tmp / "chat_template.jinja").write_text(info.chat_template)
        ends = add_end_tokens(tmp, eot)
        if provenance:
            from .provenance import write_merged_provenance

            write_merged_provenance(tmp, provenance, DTYPES[dtype], why)
    progress("save", 1.0)
    return {"path": str(out_dir), "dtype": dtype, "dtype_from": dtype_from,
            "dtype_reason": why, "rounding": ROUNDING[dtype], "tied_embeddings": tied,
            "untied": untied,
            "eos_token_id": ends, "end_of_turn": [t for t, _ in eot],
            "dequantized_from_nf4": info.load_in_4bit}
