"""Tiny Qwen2-, Llama-3- and Gemma-2-style chat models (real GPT-2 BPE + each family's specials,
real chat templates) trained through the worker's SFT path (app.data encoding, PEFT LoRA, the
CPU trainer) at a high learning rate until they answer and end the turn; then exported merged
(the base's dtype) and as GGUF (F32), and generation stops at the end-of-turn token in
transformers and in llama.cpp. Metadata: end-of-turn as eos/eot, specials typed control, BOS
as training encoded it, provenance as general.base_model.*. An untied Gemma 2 GGUF is refused.

Gemma 2's F32 GGUF passes the same 1e-3 logit tolerance as the others because training, the
verification's reference and the merged reload run its attention eager (worker.hf_attention):
with transformers' default sdpa, which drops the attention soft-cap that llama.cpp applies, the
F32 GGUF was 3.4e-2 x |top logit| away from PEFT's base + adapter; with eager 4.7e-5."""
from __future__ import annotations

import json

import pytest

from tests.export.chat_models import (FAMILIES, chat_tokenizer, save_base, template_text,
                                     llama_greedy, tiny_model, train_run)
from tests.export.conftest import need_data
from worker.export.quantize import llama_cpp_available

NO_LLAMA = llama_cpp_available()
CASES = {"qwen2": ("qwen", "Qwen-Qwen2.5-7B-Instruct"),
         "llama": ("llama3", "meta-llama-Llama-3.2-3B-Instruct"),
         "gemma2": ("gemma", "google-gemma-2-2b-it")}
ANSWER = "Hello there!"
BASE = {"name": "tiny", "source": "hf", "source_ref": "acme/tiny-chat@abc123"}


def _train(root, arch, steps=30):
    """Base folder + run folder (adapter, config.json) trained on 'answer ANSWER, end turn'."""
    import torch

    family, stem = CASES[arch]
    template = template_text(stem)
    tok = chat_tokenizer(family, template)
    pad = tok.convert_tokens_to_ids("<pad>") if family == "gemma" else None
    base = tiny_model(arch, len(tok), tok.bos_token_id, tok.eos_token_id, tied=True, pad_id=pad)
    with torch.no_grad():  # std 0.5, not 0.02: logits of a 32-wide model can then separate
        base.get_input_embeddings().weight.mul_(25.0)
    save_base(base, tok, root / "base")
    if family == "qwen":  # as Qwen2.5 ships it: transformers 5's class defaults unk to eos
        cfg_p = root / "base" / "tokenizer_config.json"
        cfg_p.write_text(json.dumps({**json.loads(cfg_p.read_text()),
                                     "tokenizer_class": "Qwen2Tokenizer"}))
    return train_run(root, template, stem, ANSWER, steps), tok


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, tmp_path_factory):
    need_data()
    root = tmp_path_factory.mktemp(request.param)
    run, tok = _train(root, request.param)
    return request.param, run, tok


def _eot(arch, tok):
    text = FAMILIES[CASES[arch][0]][3]
    return text, tok.convert_tokens_to_ids(text)


def test_merged_generation_stops_at_end_of_turn(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.jobs.export import export_run

    arch, run, tok = trained
    res = export_run(run, {"run_id": "r", "format": "merged_16bit", "dtype": "fp32"}, tmp_path,
                     base=BASE)  # fp32 on request (the default for an fp32 base is bf16)
    assert res["verification"]["passed"], res["verification"]
    assert res["merged"]["dtype"] == "fp32" and res["merged"]["dtype_from"] == "requested"
    assert "float32" in res["verification"]["checks"]["merged"]["dtype_rounding"]
    folder = tmp_path / "merged-fp32"
    eot_text, eot_id = _eot(arch, tok)
    mtok = AutoTokenizer.from_pretrained(folder)
    assert mtok.eos_token == eot_text
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = mtok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   return_dict=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out[-1] == eot_id and len(out) < 20, mtok.decode(out)  # stopped on its own
    assert mtok.decode(out[:-1]) == ANSWER


@pytest.mark.skipif(NO_LLAMA is not None, reason=str(NO_LLAMA))
def test_gguf_generation_stops_at_end_of_turn(trained, tmp_path):
    import gguf
    import numpy as np
    from llama_cpp import Llama, llama_cpp

    from worker.export.verify import trained_bos
    from worker.jobs.export import export_run

    arch, run, tok = trained
    res = export_run(run, {"run_id": "r", "format": "gguf", "quantization": ["F32"]}, tmp_path,
                     name="m", base=BASE)
    assert res["verification"]["passed"], res["verification"]
    path = tmp_path / "m-F32.gguf"
    r = gguf.GGUFReader(str(path))
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    eot_text, eot_id = _eot(arch, tok)
    assert kv["tokenizer.ggml.eot_token_id"] == eot_id
    types = kv["tokenizer.ggml.token_type"]
    specials = FAMILIES[CASES[arch][0]][0]
    assert {types[tok.convert_tokens_to_ids(s)] for s in specials} == {3}  # all control
    assert 2 not in types and "tokenizer.ggml.unknown_token_id" not in kv  # byte-level BPE
    assert kv["tokenizer.ggml.add_bos_token"] is (arch != "qwen2")  # as the templates render
    assert kv["tokenizer.ggml.add_bos_token"] is trained_bos(tok, tok.chat_template, True)
    assert (kv["general.base_model.count"], kv["general.base_model.0.name"],
            kv["general.base_model.0.organization"], kv["general.base_model.0.version"]) == (
        1, "tiny", "acme", "abc123")
    assert kv["general.base_model.0.repo_url"] == "https://huggingface.co/acme/tiny-chat/tree/abc123"
    assert res["provenance"]["adapter"]["sha256"] in kv["general.description"]
    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert llama_cpp.llama_vocab_is_eog(vocab, eot_id)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    if tok.bos_token and prompt.startswith(tok.bos_token):  # llama.cpp adds BOS as a token
        prompt = prompt[len(tok.bos_token):]
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    assert ids == tok(tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                              add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]  # = what training encoded
    out = llama_greedy(llm, ids)
    assert out[-1] == eot_id, llm.detokenize(out)
    assert llm.detokenize(out[:-1]).decode() == ANSWER
    llm.close()


def test_untied_gemma2_gguf_is_refused(tmp_path):
    """LoRA on embed_tokens unties a Gemma 2 export; llama.cpp's gemma2 always uses the token
    embedding as its head, so the GGUF would be a different model: refused, clearly."""
    need_data()
    import torch
    from peft import LoraConfig, get_peft_model

    from worker.export.files import ExportError
    from worker.jobs.export import export_run

    tok = chat_tokenizer("gemma", template_text("google-gemma-2-2b-it"))
    base = tiny_model("gemma2", len(tok), tok.bos_token_id, tok.eos_token_id, tied=True)
    save_base(base, tok, tmp_path / "base")
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.3)
    peft.save_pretrained(tmp_path / "run" / "adapter")
    (tmp_path / "run" / "config.json").write_text(json.dumps({
        "model": {"path": str(tmp_path / "base")}, "spec": {"load_in_4bit": False},
        "chat_template": {"name": "gemma", "template": tok.chat_template}}))
    with pytest.raises(ExportError) as e:
        export_run(tmp_path / "run", {"run_id": "r", "format": "gguf"}, tmp_path / "out")
    assert "GGUF cannot hold this gemma2 model" in str(e.value)
    assert "llama.cpp always uses the token embedding" in str(e.value)
    assert not list((tmp_path / "out").glob("*.gguf*"))


def test_bos_follows_training_not_the_tokenizer(stories_hf):
    """stories260K's tokenizer adds <s>; the built-in ChatML template does not render it, and
    training encodes chat renderings as they are: no BOS in the GGUF, none in verification."""
    from transformers import AutoTokenizer

    from app.data.chat_template import resolve_template
    from worker.export.verify import encode, trained_bos

    tok = AutoTokenizer.from_pretrained(stories_hf)
    chatml = resolve_template("chatml")
    assert tok("a")["input_ids"][0] == tok.bos_token_id
    assert trained_bos(tok, chatml, chat=True) is False
    assert trained_bos(tok, chatml, chat=False) is True  # text rows: the tokenizer's BOS
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=chatml,
                                     tokenize=False, add_generation_prompt=True)
    assert encode(tok, prompt, chat=True)[0] != tok.bos_token_id
    assert encode(tok, "Once", chat=False)[0] == tok.bos_token_id


def test_the_bos_is_the_runs_after_its_dataset_is_deleted(stories_hf):
    """Trial s27: once a chat run's dataset was deleted its GGUF exports took the plain-text
    branch (add_bos_token True, a BOS the run never saw: other answers in llama.cpp) and
    verification, on built-in text prompts, passed. Without the file the stand-in prompts are
    rendered as the run trained, from its data format."""
    from transformers import AutoTokenizer

    from app.data.chat_template import resolve_template
    from app.data.formats import is_chat_format
    from tests.conftest import SHARED_DATA
    from worker.export.verify import probe_set, trained_bos

    tok = AutoTokenizer.from_pretrained(stories_hf)
    chatml = resolve_template("chatml")
    data = SHARED_DATA / "sft" / "identity_alpaca.json"
    with_file, chat = probe_set(data, tok, chatml)
    assert chat is True and with_file[0].startswith("<|im_start|>user\n")
    for fmt in ("alpaca", "sharegpt", "messages", "openai", "prompts"):
        assert is_chat_format(fmt), fmt
        gone, chat_gone = probe_set(None, tok, chatml, chat_data=is_chat_format(fmt))
        assert chat_gone is True and gone[0] == ("<|im_start|>user\nOnce upon a time<|im_end|>\n"
                                                 "<|im_start|>assistant\n")
        assert trained_bos(tok, chatml, chat_gone) is trained_bos(tok, chatml, chat) is False
    for fmt in ("text", "prompt_completion", "plain"):
        assert not is_chat_format(fmt), fmt
        assert probe_set(None, tok, chatml, chat_data=is_chat_format(fmt)) == (
            ["Once upon a time", "The little dog"], False)
