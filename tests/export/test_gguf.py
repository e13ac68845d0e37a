"""GGUF exports through llama.cpp (llama-cpp-python): golden story, tokenizer files, every type.

Skips when ``llama_cpp`` is not importable (it is built from source in CI: see the report/
Makefile); the GGUF writer itself is still exercised by ``test_gguf_header_without_llama_cpp``.
"""
from __future__ import annotations

import json

import pytest

from tests.export.conftest import DATA, STORIES, need_data
from worker.export.quantize import llama_cpp_available

NO_LLAMA = llama_cpp_available()
needs_llama = pytest.mark.skipif(NO_LLAMA is not None, reason=str(NO_LLAMA))
VOCAB = DATA / "tokenizers" / "llama.cpp-vocab-gguf"


def _hf(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def test_gguf_header_without_llama_cpp(stories_hf, tmp_path):
    import gguf
    from worker.export.gguf_writer import write_gguf
    model, tok = _hf(stories_hf)
    write_gguf(model.state_dict(), model.config, tok, tmp_path / "m.gguf", "Q8_0",
               tokenizer_dir=stories_hf)
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert kv["general.architecture"] == "llama" and kv["llama.block_count"] == 5
    assert kv["llama.attention.head_count_kv"] == 4 and kv["llama.rope.dimension_count"] == 8
    assert kv["tokenizer.ggml.model"] == "llama" and len(kv["tokenizer.ggml.tokens"]) == 512
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert "output.weight" not in types  # tied embeddings
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.ffn_down.weight"] == "F16"  # rows of 172 are not a multiple of 32


@needs_llama
def test_unmodified_stories_f16_reproduces_run_c(stories_hf, tmp_path):
    """llama.cpp greedy decoding of our F16 GGUF == llama2.c's documented output."""
    import numpy as np
    from llama_cpp import Llama
    from worker.export.gguf_writer import write_gguf
    model, tok = _hf(stories_hf)
    write_gguf(model.state_dict(), model.config, tok, tmp_path / "s.gguf", "F16",
               tokenizer_dir=stories_hf)
    llm = Llama(model_path=str(tmp_path / "s.gguf"), n_ctx=320, logits_all=True, verbose=False,
                n_threads=2)
    seq = [1]
    llm.eval(seq)
    while True:  # run.c -n 256: forwards positions 0..255 (BOS first), prints 256 tokens
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if nxt == 1:
            break
        seq.append(nxt)
        if len(seq) == 257:
            break
        llm.eval([nxt])
    text = llm.detokenize(seq[1:]).decode("utf-8")
    expected = (STORIES / "greedy_t0_expected.txt").read_text()
    assert text.lstrip(" ").rstrip("\n") == expected.rstrip("\n")


@needs_llama
def test_spm_vocab_matches_llama_cpp_test_files(tmp_path):
    """Vocab GGUF written from Llama 2's tokenizer.model tokenises llama.cpp's test strings to
    the ids in ggml-vocab-llama-spm.gguf.out, and its arrays equal llama.cpp's own file."""
    need_data()
    import gguf
    from llama_cpp import Llama
    from worker.export.gguf_writer import write_vocab_only
    write_vocab_only(DATA / "tokenizers" / "llama2-sentencepiece" / "tokenizer.model",
                     tmp_path / "v.gguf")
    ours, ref = gguf.GGUFReader(tmp_path / "v.gguf"), gguf.GGUFReader(VOCAB / "ggml-vocab-llama-spm.gguf")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token"):
        assert ours.fields[key].contents() == ref.fields[key].contents(), key
    llm = Llama(model_path=str(tmp_path / "v.gguf"), vocab_only=True, verbose=False)
    inputs = (VOCAB / "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8") \
        .split("\n__ggml_vocab_test__\n")[:-1]
    outputs = (VOCAB / "ggml-vocab-llama-spm.gguf.out").read_text().split("\n")
    assert len(inputs) >= 40
    for text, want in zip(inputs, outputs):
        got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert got == [int(x) for x in want.split()], text


@needs_llama
def test_every_gguf_type_from_one_job(run_dir, tmp_path):
    from worker.jobs.export import export_run
    res = export_run(run_dir, {"run_id": "r", "format": "gguf",
                               "quantization": ["F16", "BF16", "Q8_0", "Q4_K_M", "Q6_K"]},
                     tmp_path, name="stories")
    v = res["verification"]
    assert v["passed"], json.dumps(v, indent=1)[:3000]
    assert {f["name"] for f in res["files"]} == {f"stories-{q}.gguf" for q in
                                                 ("F16", "BF16", "Q8_0", "Q4_K_M", "Q6_K")}
    for q in ("F16", "BF16", "Q8_0"):
        assert v["checks"][f"gguf_{q}"]["exact_greedy_required"]
    assert 0.0 <= v["checks"]["gguf_Q4_K_M"]["top1_agreement"] <= 1.0
    # a type without a logit tolerance is named as itself (trial s23: Q4_0 was called "K-quant")
    assert v["checks"]["gguf_Q6_K"]["rounding"] == "Q6_K: not compared"
    assert v["checks"]["gguf_Q8_0"]["rounding"].startswith("Q8_0: logits expected within 0.06")


@needs_llama
def test_ollama_export_files(run_dir, tmp_path):
    from worker.jobs.export import export_run
    res = export_run(run_dir, {"run_id": "r", "format": "ollama"}, tmp_path, name="stories")
    assert res["verification"]["passed"], res["verification"]
    assert res["verification"]["checks"]["ollama_template"]["passed"]
    mf = (tmp_path / "Modelfile").read_text()
    assert mf.startswith("FROM ./stories-Q8_0.gguf\n")
    assert 'PARAMETER stop "</s>"' in mf and 'SYSTEM """Tell a story."""' in mf
    assert res["ollama"]["created"] is False and "ollama create" in res["ollama"]["command"]
    assert (res["ollama"]["modelfile"], res["ollama"]["gguf"]) == ("Modelfile", "stories-Q8_0.gguf")
    assert res["ollama"]["command"] == "ollama create stories -f Modelfile"


@needs_llama
def test_a_type_that_fails_keeps_the_types_that_passed(run_dir, tmp_path, monkeypatch):
    """Trial s25: one GGUF type that failed lost every type of the export. Q4_K_M's quantiser
    crashes (a real SIGSEGV in the llama.cpp child) and Q5_K_M's verification crashes: the
    export fails naming both, keeps F16 and Q8_0 (verified) and leaves no other file."""
    from worker.export import llama_child
    from worker.jobs.export import VerificationFailed, export_run

    real = llama_child.call

    def call(op, kwargs, step, timeout=None, on_wait=None, **kw):
        if (op, kwargs.get("qtype")) in (("quantize", "Q4_K_M"), ("verify_gguf", "Q5_K_M")):
            return real("crash", {}, step, timeout, on_wait, module="tests.export.crashing_child")
        return real(op, kwargs, step, timeout, on_wait, **kw)

    monkeypatch.setattr(llama_child, "call", call)
    with pytest.raises(VerificationFailed) as e:
        export_run(run_dir, {"run_id": "r", "format": "gguf",
                             "quantization": ["Q4_K_M", "F16", "Q8_0", "Q5_K_M"]},
                   tmp_path, name="stories")
    res = e.value.result
    checks = res["verification"]["checks"]
    assert [f["name"] for f in res["files"]] == ["stories-F16.gguf", "stories-Q8_0.gguf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories-F16.gguf",
                                                          "stories-Q8_0.gguf"]
    assert checks["gguf_F16"]["passed"] and checks["gguf_Q8_0"]["passed"]
    crash = "llama.cpp crashed (SIGSEGV) while {} stories-{}.gguf; this export failed"
    q4, q5 = checks["gguf_Q4_K_M"], checks["gguf_Q5_K_M"]
    assert (q4["passed"], q4["type"], "removed" in q4) == (False, "Q4_K_M", False)
    assert q4["error"].startswith("not written: " + crash.format("quantising", "Q4_K_M"))
    assert (q5["passed"], q5["type"], q5["removed"]) == (False, "Q5_K_M", True)
    assert q5["error"].startswith("not verified: " + crash.format("verifying", "Q5_K_M"))
    assert not res["verification"]["passed"]
    from worker.export.verify import summarize
    said = summarize(res["verification"])
    assert said.startswith("gguf_Q4_K_M: not written: llama.cpp crashed"), said
    assert "; gguf_Q5_K_M: not verified: llama.cpp crashed" in said and "F16" not in said
