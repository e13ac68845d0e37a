"""Convert a llama2.c checkpoint and its tokenizer ``.bin`` into a Hugging Face Llama folder.

Formats (see ``shared/data/README.md`` §1a):

* **legacy v0**: 7 int32 header ``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
  max_seq_len`` (``vocab_size < 0`` means an untied classifier ``wcls`` at the end), then the
  fp32 tensors tok_embeddings, attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3, norm,
  freq_cis_real, freq_cis_imag, [wcls];
* **v1**: 256-byte header (magic ``ak42``, version 1, the 7 params, uint8 shared_classifier),
  then the norms, tok_embeddings, wq, wk, wv, wo, w1, w2, w3, [wcls] (no RoPE tables).

llama2.c rotates interleaved pairs while HF Llama uses ``rotate_half``, so ``q_proj``/``k_proj``
rows are permuted: ``W.view(H, D/H/2, 2, in).transpose(1, 2).reshape(D, in)``.

The tokenizer ``.bin`` holds (score, piece) pairs of a SentencePiece BPE model with byte fallback;
it is rebuilt as a ``tokenizers`` BPE whose merge priority follows the pieces' scores (the
merged piece with the highest score merges first, exactly as run.c's ``encode`` does), with the
add-dummy-prefix behaviour of SentencePiece (a ``▁`` before the text, spaces as ``▁``).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPIECE_SPACE = "\u2581"
V1_MAGIC = 0x616B3432


class Llama2cFormatError(ValueError):
    """The file is not a llama2.c checkpoint/tokenizer this converter understands."""


@dataclass(frozen=True)
class Llama2cConfig:
    """Hyper-parameters from a llama2.c header."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    shared_classifier: bool
    version: int


def read_checkpoint(path: str | Path) -> tuple[Llama2cConfig, dict[str, np.ndarray]]:
    """Read a v0 or v1 fp32 llama2.c checkpoint into llama2.c-named numpy arrays.

    Returns the config and ``{"tok_embeddings": [V,D], "attention_norm": [L,D], "wq": [L,D,D],
    ..., "wcls": [V,D] (only when untied)}``. Raises :class:`Llama2cFormatError`.
    """
    raw = Path(path).read_bytes()
    if len(raw) < 28:
        raise Llama2cFormatError(f"{path}: too small to be a llama2.c checkpoint")
    magic = struct.unpack_from("<I", raw, 0)[0]
    if magic == V1_MAGIC:
        version = struct.unpack_from("<i", raw, 4)[0]
        if version != 1:
            raise Llama2cFormatError(
                f"{path}: this llama2.c checkpoint version is not supported "
                "(only fp32 legacy v0 and v1; v2 is Q8_0)")
        params = struct.unpack_from("<7i", raw, 8)
        shared = bool(raw[36])
        offset = 256
    else:
        version = 0
        params = struct.unpack_from("<7i", raw, 0)
        shared = params[5] > 0
        offset = 28
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = params
    vocab = abs(vocab)
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len) <= 0 or dim % n_heads:
        raise Llama2cFormatError(f"{path}: not a llama2.c checkpoint (its header does not hold "
                                 "positive sizes with dim divisible by n_heads)")
    cfg = Llama2cConfig(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len, shared, version)
    head = dim // n_heads
    kv_dim = n_kv * head
    shapes = {
        "tok_embeddings": (vocab, dim),
        "attention_norm": (n_layers, dim),
        "ffn_norm": (n_layers, dim),
        "norm": (dim,),
        "wq": (n_layers, dim, dim),
        "wk": (n_layers, kv_dim, dim),
        "wv": (n_layers, kv_dim, dim),
        "wo": (n_layers, dim, dim),
        "w1": (n_layers, hidden, dim),
        "w2": (n_layers, dim, hidden),
        "w3": (n_layers, hidden, dim),
        "freq_cis_real": (seq_len, head // 2),
        "freq_cis_imag": (seq_len, head // 2),
        "wcls": (vocab, dim),
    }
    if version == 0:
        order = ["tok_embeddings", "attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1",
                 "w2", "w3", "norm", "freq_cis_real", "freq_cis_imag"]
    else:
        order = ["attention_norm", "ffn_norm", "norm", "tok_embeddings", "wq", "wk", "wv", "wo",
                 "w1", "w2", "w3"]
    if not shared:
        order.append("wcls")
    need = offset + 4 * sum(int(np.prod(shapes[k])) for k in order)
    if len(raw) != need:
        raise Llama2cFormatError(  # the header's values are file content: never quoted
            f"{path}: not a llama2.c checkpoint (its size, {len(raw)} bytes, does not match "
            "the sizes its header declares)")
    out: dict[str, np.ndarray] = {}
    for name in order:
        n = int(np.prod(shapes[name]))
        out[name] = np.frombuffer(raw, dtype="<f4", count=n, offset=offset).reshape(shapes[name])
        offset += 4 * n
    out.pop("freq_cis_real", None)
    out.pop("freq_cis_imag", None)
    return cfg, out


def _permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama2.c interleaved-pair rows -> HF rotate_half rows for q/k projections."""
    d, d_in = w.shape
    return w.reshape(n_heads, d // n_heads // 2, 2, d_in).transpose(0, 2, 1, 3).reshape(d, d_in)


def to_hf_state_dict(cfg: Llama2cConfig, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Map llama2.c arrays to ``LlamaForCausalLM`` parameter names (q/k permuted)."""
    sd: dict[str, np.ndarray] = {"model.embed_tokens.weight": w["tok_embeddings"],
                                 "model.norm.weight": w["norm"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = w["attention_norm"][i]
        sd[p + "post_attention_layernorm.weight"] = w["ffn_norm"][i]
        sd[p + "self_attn.q_proj.weight"] = _permute_rope(w["wq"][i], cfg.n_heads)
        sd[p + "self_attn.k_proj.weight"] = _permute_rope(w["wk"][i], cfg.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = w["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = w["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = w["w1"][i]
        sd[p + "mlp.down_proj.weight"] = w["w2"][i]
        sd[p + "mlp.up_proj.weight"] = w["w3"][i]
    sd["lm_head.weight"] = w["tok_embeddings"] if cfg.shared_classifier else w["wcls"]
    return sd


def read_tokenizer(path: str | Path, vocab_size: int) -> list[tuple[str, float]]:
    """Read a llama2.c tokenizer ``.bin``: ``[(piece, score), ...]`` for ``vocab_size`` ids."""
    raw = Path(path).read_bytes()
    off = 4  # int32 max_token_length
    out: list[tuple[str, float]] = []
    try:
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", raw, off)
            off += 8
            piece = raw[off:off + n].decode("utf-8")
            if len(piece.encode("utf-8")) != n:
                raise Llama2cFormatError(f"{path}: truncated piece at id {len(out)}")
            off += n
            out.append((piece, score))
    except (struct.error, UnicodeDecodeError) as e:  # no detail: it would quote file bytes
        raise Llama2cFormatError(f"{path}: not a llama2.c tokenizer for {vocab_size} tokens "
                                 f"(unreadable after {len(out)} pieces)") from None
    if off != len(raw):
        raise Llama2cFormatError(f"{path}: {len(raw) - off} trailing bytes after {vocab_size} "
                                 "tokens; the tokenizer does not match the checkpoint's vocab")
    return out


def build_hf_tokenizer(pieces: list[tuple[str, float]]):
    """A ``tokenizers.Tokenizer`` equivalent to run.c's encode/decode for these pieces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab: dict[str, int] = {}
    for i, (piece, _) in enumerate(pieces):
        if i < 3:  # llama2.c exports BOS/EOS as "\n<s>\n" / "\n</s>\n"; use SentencePiece names
            piece = ("<unk>", "<s>", "</s>")[i]
        elif not (piece.startswith("<0x") and len(piece) == 6):
            piece = piece.replace(" ", SPIECE_SPACE)
        vocab.setdefault(piece, i)
    # Every piece that is the concatenation of two pieces is a merge; the highest score merges
    # first (SentencePiece BPE and run.c), ties broken by id.
    normal = {p: i for p, i in vocab.items() if i >= 259}
    merges: list[tuple[float, int, tuple[str, str]]] = []
    for piece, pid in normal.items():
        score = pieces[pid][1]
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                merges.append((-score, pid, (left, right)))
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[m[2] for m in merges], unk_token="<unk>",
                     byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE),
                                           normalizers.Replace(" ", SPIECE_SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def convert(checkpoint: str | Path, tokenizer: str | Path, out_dir: str | Path) -> dict:
    """Write a HF folder (safetensors, config, generation config, tokenizer) to ``out_dir``.

    Returns model info: ``{"params", "layers", "vocab", "max_position_embeddings", ...}``.
    Raises :class:`Llama2cFormatError` on a malformed file.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg, arrays = read_checkpoint(checkpoint)
    pieces = read_tokenizer(tokenizer, cfg.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
        tie_word_embeddings=cfg.shared_classifier, bos_token_id=1, eos_token_id=2,
        pad_token_id=None, torch_dtype="float32")
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    sd = {k: torch.from_numpy(np.array(v, dtype=np.float32))
          for k, v in to_hf_state_dict(cfg, arrays).items()}
    if cfg.shared_classifier:
        sd.pop("lm_head.weight")
    model.load_state_dict(sd, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise Llama2cFormatError(f"parameters left unset by the conversion: {missing}")
    model.eval()
    # TinyStories documents are separated by BOS (run.c stops on id 1), so both stop generation.
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[1, 2],
                                               max_length=cfg.max_seq_len)
    model.save_pretrained(out, safe_serialization=True)

    tok = build_hf_tokenizer(pieces)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "legacy": False,
        "model_max_length": cfg.max_seq_len,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))
    n_params = sum(p.numel() for p in model.parameters())
    return {"params": int(n_params), "layers": cfg.n_layers, "vocab": cfg.vocab_size,
            "hidden_size": cfg.dim, "max_position_embeddings": cfg.max_seq_len,
            "architecture": "LlamaForCausalLM", "source_format": f"llama2c-v{cfg.version}",
            "tied_embeddings": cfg.shared_classifier}
