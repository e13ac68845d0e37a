"""llama2.c -> Hugging Face conversion of the real stories260K model and its tokenizer."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from worker.engine.llama2c import (Llama2cFormatError, convert, read_checkpoint,  # noqa: E402
                                   read_tokenizer)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = SHARED_DATA / "models" / "stories260K"
pytestmark = pytest.mark.skipif(not STORIES.exists(), reason=f"no test data at {SHARED_DATA}")


def test_greedy_decoding_reproduces_run_c(stories_hf: Path) -> None:
    """run.c -t 0 prints 256 sampled pieces after BOS, then a newline; it strips the leading
    space of the first piece after BOS (our decoder's Strip does the same)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_hf)
    model = AutoModelForCausalLM.from_pretrained(stories_hf)
    out = model.generate(torch.tensor([[tok.bos_token_id]]), max_new_tokens=256, do_sample=False)
    new = out[0, 1:].tolist()
    assert len(new) == 256 and 1 not in new and 2 not in new
    expected = (STORIES / "greedy_t0_expected.txt").read_text(encoding="utf-8")
    assert tok.decode(new) + "\n" == expected


def test_generation_stops_on_bos_like_run_c(stories_hf: Path) -> None:
    """TinyStories are separated by BOS: generate stops when BOS is emitted (token #346)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stories_hf)
    out = model.generate(torch.tensor([[1]]), max_new_tokens=400, do_sample=False)
    assert out.shape[1] == 1 + 346 and out[0, -1].item() == 1


def _run_c_encode(pieces: list[tuple[str, float]], text: str) -> list[int]:
    """llama2.c run.c ``encode`` (BOS, dummy prefix, byte fallback, best-score merges)."""
    lookup = {p: i for i, (p, _) in enumerate(pieces) if i >= 3}
    ids = [1]
    if text:
        ids.append(lookup[" "])
    for ch in text:
        if ch in lookup:
            ids.append(lookup[ch])
        else:
            ids.extend(b + 3 for b in ch.encode("utf-8"))
    while True:
        best, best_i = None, -1
        for i in range(1, len(ids) - 1):
            a, b = ids[i], ids[i + 1]
            merged = pieces[a][0] + pieces[b][0] if a >= 259 and b >= 259 else None
            j = lookup.get(merged) if merged is not None else None
            if j is not None and j >= 259 and (best is None or pieces[j][1] > pieces[best][1]):
                best, best_i = j, i
        if best is None:
            return ids
        ids[best_i:best_i + 2] = [best]


def _stories() -> list[str]:
    head = (SHARED_DATA / "pretrain_text" / "tinystories_train_head.txt").read_text("utf-8")
    paras = [p for p in head.split("\n\n") if p.strip()]
    return paras[:150] + [head[:4000], "", " leading space", "tabs\tand  double  spaces ",
                          "Unicode: café, naïve, 😀 — “quotes”"]


def test_tokenizer_matches_run_c_and_round_trips(stories_hf: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_hf)
    pieces = read_tokenizer(STORIES / "tok512.bin", 512)
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 259]) == ["<unk>", "<s>", "</s>", "<0x00>", "▁t"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    assert tok.chat_template is None
    for text in _stories():
        ids = tok(text)["input_ids"]
        if text.isascii() and "\t" not in text:
            assert ids == _run_c_encode(pieces, text), text[:60]
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_v1_header_and_untied_classifier(tmp_path: Path) -> None:
    """A v1 export (256-byte header, other tensor order) and an untied v0 file convert too."""
    from transformers import AutoModelForCausalLM

    cfg, w = read_checkpoint(STORIES / "stories260K.bin")
    params = [cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size,
              cfg.max_seq_len]
    wcls = np.random.default_rng(0).standard_normal(w["tok_embeddings"].shape).astype("<f4")
    v1 = tmp_path / "v1.bin"
    header = struct.pack("<Ii7iB", 0x616B3432, 1, *params, 0).ljust(256, b"\0")
    order = ["attention_norm", "ffn_norm", "norm", "tok_embeddings", "wq", "wk", "wv", "wo", "w1",
             "w2", "w3"]
    v1.write_bytes(header + b"".join(w[k].astype("<f4").tobytes() for k in order)
                   + wcls.tobytes())
    cfg1, w1 = read_checkpoint(v1)
    assert cfg1.version == 1 and not cfg1.shared_classifier
    assert np.array_equal(w1["wcls"], wcls) and np.array_equal(w1["wq"], w["wq"])

    info = convert(v1, STORIES / "tok512.bin", tmp_path / "hf1")
    assert info["source_format"] == "llama2c-v1" and not info["tied_embeddings"]
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf1")
    assert torch.equal(m.lm_head.weight, torch.from_numpy(wcls))
    assert not torch.equal(m.lm_head.weight, m.model.embed_tokens.weight)

    v0u = tmp_path / "v0u.bin"
    raw = (STORIES / "stories260K.bin").read_bytes()
    params[5] = -params[5]
    v0u.write_bytes(struct.pack("<7i", *params) + raw[28:] + wcls.tobytes())
    cfg0, w0 = read_checkpoint(v0u)
    assert cfg0.version == 0 and not cfg0.shared_classifier and np.array_equal(w0["wcls"], wcls)


def test_bad_files_are_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes((STORIES / "stories260K.bin").read_bytes()[:-4])
    with pytest.raises(Llama2cFormatError, match="does not match"):
        read_checkpoint(bad)
    with pytest.raises(Llama2cFormatError):
        read_tokenizer(STORIES / "tok512.bin", 300)
