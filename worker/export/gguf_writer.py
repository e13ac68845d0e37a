"""GGUF export (GGUF v3 via the ``gguf`` package) of a merged model, as llama.cpp loads it.

Supported HF architectures → llama.cpp ``general.architecture``:
``LlamaForCausalLM``/``MistralForCausalLM`` → ``llama``; ``Qwen2ForCausalLM`` → ``qwen2``;
``Qwen3ForCausalLM`` → ``qwen3``; ``GemmaForCausalLM`` → ``gemma``; ``Gemma2ForCausalLM`` →
``gemma2``. Tensor names come from ``gguf.get_tensor_name_map`` (``blk.N.attn_q.weight`` ...).

Layout rules (llama.cpp's model loader, ``src/llama-model.cpp``):

* ``llama`` uses "normal" RoPE (rotates interleaved pairs 2i, 2i+1) while HF Llama/Mistral use
  ``rotate_half`` (pairs i, i+D/2), so q/k rows are permuted per head back to interleaved order:
  ``W.view(H, 2, D/H/2, in).transpose(1, 2)``. Qwen2/3 and Gemma use NEOX RoPE (= rotate_half):
  no permutation.
* Gemma's RMSNorm multiplies by ``1 + w``; llama.cpp multiplies by ``w``, so 1 is added to
  every Gemma norm weight. Gemma scales embeddings by sqrt(hidden) at run time in both.
* Tied embeddings: no ``output.weight``; llama.cpp then reuses ``token_embd.weight``. Gemma and
  Gemma 2 always reuse it (their llama.cpp tensor lists have no ``output``), so an untied Gemma
  (a base with its own head, or LoRA on ``embed_tokens`` that untied the export) is refused.
* Provenance (GGUF spec, "General metadata"): ``general.base_model.count`` = 1 and
  ``general.base_model.0.{name,organization,repo_url}`` for the base, ``general.description``
  naming the adapter (run, sha256, r, alpha) and the base weights it was merged into.
* 1-D tensors (norms, biases) stay F32; 2-D weights take the requested type; Q8_0 needs rows
  that are a multiple of 32 values (``gguf.quants``), other rows fall back to F16.

Types written here: F32, F16, BF16, Q8_0 (``general.file_type`` 0, 1, 32, 7). K-quants are made
from the F16 file by llama.cpp's quantiser, see :mod:`worker.export.quantize`.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .files import ExportError, ProgressFn, atomic_path, noop_progress
from .gguf_vocab import vocab_from_tokenizer, write_vocab

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2"}
PERMUTE_QK = {"llama"}
GEMMA = {"gemma", "gemma2"}
BASE_TYPES = ("F32", "F16", "BF16", "Q8_0")


def _cfg(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    rp = getattr(config, "rope_parameters", None) or {}
    for n in names:
        if n in rp and rp[n] is not None:
            return rp[n]
    return default


def interleave_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF ``rotate_half`` rows -> llama.cpp interleaved-pair rows (per head)."""
    d, d_in = w.shape[0], int(np.prod(w.shape[1:])) if w.ndim > 1 else 1
    out = w.reshape(n_heads, 2, d // n_heads // 2, d_in).swapaxes(1, 2)
    return out.reshape(w.shape)


def arch_of(config) -> str:
    """llama.cpp architecture name for a HF config; raises :class:`ExportError`."""
    names = getattr(config, "architectures", None) or []
    for n in names:
        if n in ARCHS:
            return ARCHS[n]
    raise ExportError(f"GGUF export supports {sorted(ARCHS)}; this model is {names or '?'}")


def _hparams(w, arch: str, config, n_vocab: int) -> None:
    """Architecture metadata: sizes, heads, norms, RoPE (``{arch}.*`` keys)."""
    import gguf

    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = _cfg(config, "head_dim", default=None) or hidden // heads
    w.add_context_length(int(config.max_position_embeddings))
    w.add_embedding_length(int(hidden))
    w.add_block_count(int(config.num_hidden_layers))
    w.add_feed_forward_length(int(config.intermediate_size))
    w.add_head_count(int(heads))
    w.add_head_count_kv(int(_cfg(config, "num_key_value_heads", default=heads)))
    w.add_layer_norm_rms_eps(float(_cfg(config, "rms_norm_eps", default=1e-6)))
    w.add_rope_freq_base(float(_cfg(config, "rope_theta", default=10000.0)))
    w.add_rope_dimension_count(int(head_dim))
    if head_dim != hidden // heads or arch in ("qwen3", "gemma", "gemma2"):
        w.add_key_length(int(head_dim))
        w.add_value_length(int(head_dim))
    w.add_vocab_size(int(n_vocab))
    scaling = _cfg(config, "rope_scaling", default=None) or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    elif kind not in (None, "default", "llama3"):
        raise ExportError(f"RoPE scaling {kind!r} is not supported for GGUF export")
    if arch == "gemma2":
        for key, fn in (("attn_logit_softcapping", w.add_attn_logit_softcapping),
                        ("final_logit_softcapping", w.add_final_logit_softcapping)):
            if getattr(config, key, None):
                fn(float(getattr(config, key)))
        if getattr(config, "sliding_window", None):
            w.add_sliding_window(int(config.sliding_window))


def llama3_rope_freqs(config) -> np.ndarray | None:
    """Per-frequency divisors for ``rope_type == "llama3"`` (llama.cpp ``rope_freqs.weight``).

    Meta's Llama 3.1 scheme: wavelengths above ``orig_ctx / low_freq_factor`` are slowed by
    ``factor``, below ``orig_ctx / high_freq_factor`` kept, smoothly interpolated between.
    """
    s = _cfg(config, "rope_scaling", default=None) or {}
    if (s.get("rope_type") or s.get("type")) != "llama3":
        return None
    base = float(_cfg(config, "rope_theta", default=10000.0))
    dim = _cfg(config, "head_dim", default=None) or config.hidden_size // config.num_attention_heads
    factor, lo, hi = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    orig = s.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < orig / hi:
            out.append(1.0)
        elif wavelen > orig / lo:
            out.append(factor)
        else:
            smooth = (orig / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _encode(name: str, arr: np.ndarray, qtype: str):
    """(data, raw_dtype) for ``add_tensor``: 1-D stays F32; 2-D as ``qtype`` (Q8_0 -> F16
    fallback when the row length is not a multiple of 32)."""
    import gguf

    T = gguf.GGMLQuantizationType
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.ndim == 1 or qtype == "F32":
        return arr, None
    if qtype == "F16" or (qtype == "Q8_0" and arr.shape[-1] % 32):
        return arr.astype(np.float16), None
    if qtype == "BF16":
        return gguf.quants.quantize(arr, T.BF16), T.BF16
    if qtype == "Q8_0":
        return gguf.quants.quantize(arr, T.Q8_0), T.Q8_0
    raise ExportError(f"GGUF type {qtype!r} is not one of {BASE_TYPES}")


def gguf_tensors(state: dict, config, arch: str):
    """Yield ``(gguf_name, float32 array)`` in llama.cpp's layout (see the module docstring)."""
    import gguf

    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()),
                                    config.num_hidden_layers)
    heads = config.num_attention_heads
    kv = _cfg(config, "num_key_value_heads", default=heads)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if arch in GEMMA and not tied and "lm_head.weight" in state:
        raise ExportError(f"GGUF cannot hold this {arch} model: its output head differs from its "
                          "token embedding (untied, e.g. by LoRA on embed_tokens), and llama.cpp "
                          "always uses the token embedding as the output of Gemma models. Export "
                          "merged_16bit instead, or train without embed_tokens in target_modules")
    freqs = llama3_rope_freqs(config)
    if freqs is not None:
        yield "rope_freqs.weight", freqs
    for name, t in state.items():
        if name == "lm_head.weight" and tied:
            continue
        if "rotary_emb" in name:
            continue
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ExportError(f"no GGUF name for tensor {name!r} ({arch})")
        arr = t.detach().float().cpu().numpy()
        if arch in PERMUTE_QK and name.endswith("q_proj.weight"):
            arr = interleave_qk(arr, heads)
        elif arch in PERMUTE_QK and name.endswith("k_proj.weight"):
            arr = interleave_qk(arr, kv)
        elif arch in PERMUTE_QK and name.endswith(("q_proj.bias", "k_proj.bias")):
            arr = interleave_qk(arr, heads if "q_proj" in name else kv)
        if arch in GEMMA and name.endswith("norm.weight"):
            arr = arr + 1.0
        yield new, arr


FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}


def write_gguf(state: dict, config, tok, out_path: str | Path, qtype: str = "F16", *,
               chat_template: str | None = None, eot_id: int | None = None,
               tokenizer_dir: Path | None = None, name: str = "whetstone-export",
               add_bos: bool | None = None, provenance: dict | None = None,
               progress: ProgressFn = noop_progress) -> dict:
    """Write one GGUF file (atomically); returns ``{"path", "type", "arch", "tensors"}``.

    ``state``: the merged model's tensors (any float dtype, converted to float32 numpy);
    ``add_bos``: ``tokenizer.ggml.add_bos_token`` (None: what ``tok`` does on plain text; an
    export passes what training did, :func:`worker.export.verify.trained_bos`); ``provenance``:
    :func:`worker.export.provenance.provenance`'s dict, written as ``general.base_model.*``.
    Raises :class:`ExportError` (unsupported architecture, type or tensor; untied Gemma)."""
    import gguf

    arch = arch_of(config)
    if qtype not in BASE_TYPES:
        raise ExportError(f"GGUF type {qtype!r}: written types are {BASE_TYPES}; "
                          "K-quants are made from F16 by quantize.py")
    vocab = vocab_from_tokenizer(tok, tokenizer_dir, arch, int(config.vocab_size))
    if add_bos is not None:
        vocab["add_bos"] = bool(add_bos)
    items = list(gguf_tensors(state, config, arch))
    with atomic_path(out_path) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(name)
        if provenance:
            add_provenance(w, provenance)
        _hparams(w, arch, config, len(vocab["tokens"]))
        w.add_file_type(FILE_TYPE[qtype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_vocab(w, vocab, chat_template, eot_id)
        names = []
        for k, (tname, arr) in enumerate(items):
            data, raw = _encode(tname, arr, qtype)
            if raw is None:
                w.add_tensor(tname, data)
            else:
                w.add_tensor(tname, data, raw_shape=data.shape, raw_dtype=raw)
            names.append(tname)
            progress(f"gguf {qtype}", 0.9 * (k + 1) / len(items))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    progress(f"gguf {qtype}", 1.0)
    return {"path": str(out_path), "type": qtype, "arch": arch, "tensors": len(names)}


def add_provenance(w, prov: dict) -> None:
    """``general.base_model.*`` (GGUF spec) and ``general.description`` from ``prov``."""
    hub = prov.get("base_model") or ""
    hf = prov.get("base_model_source") == "hf" and "/" in hub
    w.add_base_model_count(1)
    w.add_base_model_name(0, prov.get("base_model_name") or hub)
    if hf:
        rev = prov.get("base_model_revision")
        w.add_base_model_organization(0, hub.split("/")[0])
        w.add_base_model_repo_url(0, f"https://huggingface.co/{hub}"
                                  + (f"/tree/{rev}" if rev else ""))
        if rev:
            w.add_base_model_version(0, rev)
    a = prov.get("adapter") or {}
    weights = prov.get("base_weights")
    name = prov.get("base_model_name") or hub
    w.add_description(f"{name}{f' ({hub})' if hub != name else ''} + LoRA adapter of run "
                      f"{a.get('run_id')} (r={a.get('r')}, lora_alpha={a.get('lora_alpha')}, "
                      f"adapter_model.safetensors sha256 {a.get('sha256')}), merged into the "
                      f"base's {weights} weights")


def write_vocab_only(tok, out_path: str | Path, tokenizer_dir: Path | None = None,
                     arch: str = "llama") -> None:
    """A tensor-free GGUF holding only the tokenizer (for tokenisation tests). ``tok`` is a HF
    tokenizer, or a path to a SentencePiece ``tokenizer.model``."""
    import gguf

    from .gguf_vocab import vocab_from_sentencepiece

    v = (vocab_from_sentencepiece(Path(tok)) if isinstance(tok, (str, Path))
         else vocab_from_tokenizer(tok, tokenizer_dir, arch, len(tok)))
    with atomic_path(out_path) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        for fn, val in ((w.add_context_length, 4096), (w.add_embedding_length, 4096),
                        (w.add_block_count, 1), (w.add_feed_forward_length, 4096),
                        (w.add_head_count, 32), (w.add_head_count_kv, 32),
                        (w.add_rope_dimension_count, 128), (w.add_vocab_size, len(v["tokens"]))):
            fn(val)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_file_type(1)
        write_vocab(w, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
