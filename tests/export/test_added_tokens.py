"""A base model whose tokenizer lacks the chat template's markers (GPT-2 BPE + the real Qwen2.5
ChatML template): training adds ``<|im_start|>``/``<|im_end|>`` as special tokens, grows the
tied embedding and trains the new rows with PEFT's ``trainable_token_indices`` beside LoRA; every
export carries the new vocabulary and stops at the new end-of-turn token (merged in
transformers, GGUF in llama.cpp, the Ollama Modelfile's stop), and verification passes."""
from __future__ import annotations

import json

import pytest

from tests.export.chat_models import (chat_tokenizer, llama_greedy, save_base, template_text,
                                     tiny_model, train_run)
from tests.export.conftest import need_data
from worker.export.quantize import llama_cpp_available

NO_LLAMA = llama_cpp_available()
ANSWER = "Hello there!"
STEPS = 30


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run folder, the run's tokenizer, new ids) of a tiny Qwen2 trained with added tokens."""
    need_data()
    import torch

    from worker.engine import data as edata
    from worker.engine import sft
    from worker.engine.new_tokens import add_tokens, missing_template_tokens

    root = tmp_path_factory.mktemp("added")
    template = template_text("Qwen-Qwen2.5-7B-Instruct")
    base_tok = chat_tokenizer("gpt2", template)
    base = tiny_model("qwen2", len(base_tok), None, base_tok.eos_token_id, tied=True)
    with torch.no_grad():
        base.get_input_embeddings().weight.mul_(25.0)
    save_base(base, base_tok, root / "base")
    missing = missing_template_tokens(base_tok, template)
    assert missing == ["<|im_start|>", "<|im_end|>"]
    assert len(base_tok("<|im_end|>", add_special_tokens=False)["input_ids"]) > 1  # plain text

    model = sft.load_model(str(root / "base"), False, False)
    tok = sft.load_tokenizer(str(root / "base"), template)
    ids = add_tokens(model, tok, missing)
    assert ids == [len(base_tok), len(base_tok) + 1] and len(tok) == len(base_tok) + 2
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    run = train_run(root, template, "qwen", ANSWER, STEPS, model=model, tok=tok,
                    new_token_ids=ids, learning_rate=3e-2)
    enc = edata.build_dataset(root / "chat.jsonl", root / "tokenizer", template, 256, True)
    assert enc.dataset[0]["input_ids"][0] == ids[0]  # training saw <|im_start|> as one token
    return run, tok, ids


def _prompt_text(tok, answered: bool = False) -> str:
    """The chat prompt for "Hi"; ``answered``: with the trained answer already written, so the
    next token is the end of the turn the training taught. (Whether a 30-step run on a
    2-layer model also reproduces the whole answer from the prompt depends on the CPU's float
    rounding: lr 3e-2 spikes the loss, and a host with other vector units diverged to "Hello
    there there there..."; the end-of-turn after the answer was learned on every seed tried.)"""
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    return text + ANSWER if answered else text


def _prompt_ids(tok, answered: bool = False) -> list[int]:
    return tok(_prompt_text(tok, answered), add_special_tokens=False)["input_ids"]


def test_merged_has_the_new_vocabulary_and_stops(run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.jobs.export import export_run

    run_dir, tok, (start, end) = run
    res = export_run(run_dir, {"run_id": "r", "format": "merged_16bit", "dtype": "fp32"},
                     tmp_path)
    assert res["verification"]["passed"], res["verification"]
    folder = tmp_path / "merged-fp32"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["vocab_size"] == len(tok) and cfg["tie_word_embeddings"] is True
    mtok = AutoTokenizer.from_pretrained(folder)
    assert len(mtok) == len(tok) and mtok.eos_token == "<|im_end|>"
    assert mtok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [start, end]
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = _prompt_ids(mtok, answered=True)
    assert ids[0] == start
    out = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):]
    assert out.tolist() == [end], mtok.decode(out)  # the new end of turn, and generation stopped


@pytest.mark.skipif(NO_LLAMA is not None, reason=str(NO_LLAMA))
def test_gguf_and_ollama_carry_the_new_tokens(run, tmp_path):
    import gguf
    from llama_cpp import Llama, llama_cpp

    from worker.jobs.export import export_run

    run_dir, tok, (start, end) = run
    res = export_run(run_dir, {"run_id": "r", "format": "ollama", "quantization": ["F32"]},
                     tmp_path, name="m")
    assert res["verification"]["passed"], res["verification"]
    # llama.cpp with an F32 KV cache computes what PEFT does (0.0 here; 1.1e-4 with its default F16 cache)
    assert res["verification"]["checks"]["gguf_F32"]["max_logit_error"] < 1e-5
    path = tmp_path / "m-F32.gguf"
    kv = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()
          if not k.startswith("GGUF.")}
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(tokens) == len(tok) == kv["qwen2.vocab_size"]
    assert tokens[start:end + 1] == ["<|im_start|>", "<|im_end|>"]
    assert types[start] == types[end] == 3  # control
    assert kv["tokenizer.ggml.eot_token_id"] == end
    modelfile = (tmp_path / "Modelfile").read_text()
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and "FROM ./m-F32.gguf" in modelfile
    llm = Llama(model_path=str(path), n_ctx=256, verbose=False, n_threads=2)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert llama_cpp.llama_vocab_is_eog(vocab, end)
    ids = llm.tokenize(_prompt_text(tok, answered=True).encode(), add_bos=False, special=True)
    assert ids == _prompt_ids(tok, answered=True)
    out = llama_greedy(llm, ids)
    assert out == [end], llm.detokenize(out)  # the new end of turn ends generation in llama.cpp
    llm.close()


MISSING_FROM_GPT2 = {
    "Qwen-Qwen2.5-7B-Instruct": ["<|im_start|>", "<|im_end|>"],
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ["<｜User｜>", "<｜Assistant｜>",
                                                 "<｜end▁of▁sentence｜>"],
    "google-gemma-2-2b-it": ["<start_of_turn>", "<end_of_turn>"],
    "meta-llama-Llama-3.1-8B-Instruct": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "meta-llama-Llama-3.2-3B-Instruct": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "microsoft-Phi-3.5-mini-instruct": ["<|system|>", "<|end|>", "<|user|>", "<|assistant|>"],
    "mistralai-Mistral-Nemo-Instruct-2407": ["[INST]", "[/INST]"],
}


def test_template_markers_a_base_lacks():
    """Every real template's markers: none missing from its own family's tokenizer, all of them
    (not DeepSeek's <think>, which the model writes) missing from a base GPT-2 tokenizer."""
    need_data()
    from tests.export.chat_models import TEMPLATE_FAMILY
    from worker.engine.new_tokens import missing_template_tokens

    base = chat_tokenizer("gpt2")
    assert set(MISSING_FROM_GPT2) == set(TEMPLATE_FAMILY)
    for stem, family in TEMPLATE_FAMILY.items():
        template = template_text(stem)
        assert missing_template_tokens(chat_tokenizer(family), template) == [], stem
        assert missing_template_tokens(base, template) == MISSING_FROM_GPT2[stem], stem
