"""Chat templates against transformers' apply_chat_template, response masks, tokenizer
loading, and the dataset report on real files."""
from __future__ import annotations

import json

import pytest
from datalayer_paths import EXPECTED_ROWS, GPT2, SHARED, template_files

from app.data.chat_template import (DEFAULT_TEMPLATES, list_default_templates, render_chat,
                                    render_with_spans, resolve_template)
from app.data.encode import (IGNORE_INDEX, TokenizerBundle, byte_level_bpe, encode_example,
                             load_tokenizer_bundle)
from app.data.errors import DatasetError
from app.data.report import inspect_dataset, iter_encoded

CONV = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": " Seven. "},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "Two is the only even prime."},
]
ALL_TEMPLATES = {p.stem: p.read_text() for p in template_files()} | {
    f"builtin-{k}": v for k, v in DEFAULT_TEMPLATES.items()}


def _conv_for(name):
    return CONV[1:] if "gemma" in name else CONV  # gemma-2 raises on a system turn


@pytest.fixture(scope="module")
def hf_tokenizer(gpt2_tokenizer):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer, bos_token="<s>",
                                                eos_token="</s>")


def test_gpt2_bpe_matches_llama_cpp_goldens(gpt2_tokenizer):
    """Our byte-level BPE from vocab/merges (no #version header) reproduces GPT-2 ids."""
    base = SHARED / "tokenizers" / "llama.cpp-vocab-gguf" / "ggml-vocab-gpt-2.gguf"
    inputs = base.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = base.with_suffix(".gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(outputs) >= 40
    for text, ids in zip(inputs, outputs):
        assert gpt2_tokenizer.encode(text, add_special_tokens=False).ids == [int(x) for x in ids.split()], text
    assert gpt2_tokenizer.encode(" t").tokens == ["Ġt"]


@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_render_matches_transformers(name, hf_tokenizer):
    tpl, conv = ALL_TEMPLATES[name], _conv_for(name)
    for gen in (False, True):
        ours = render_chat(conv, tpl, bos_token="<s>", eos_token="</s>", add_generation_prompt=gen,
                           special_tokens={"pad_token": "<pad>"})
        theirs = hf_tokenizer.apply_chat_template(conv, chat_template=tpl, tokenize=False,
                                                  add_generation_prompt=gen)
        assert ours == theirs


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct",
                                  "builtin-chatml"])
def test_render_with_tools_matches_transformers(name, hf_tokenizer):
    row = json.loads((SHARED / "sft" / "glaive_toolcall_en_demo_sharegpt.json").read_text())[0]
    from app.data.formats import normalize_row
    ex, _ = normalize_row(row, "sharegpt", 1)
    tpl = ALL_TEMPLATES[name]
    ours = render_chat(ex["messages"], tpl, bos_token="<s>", eos_token="</s>", tools=ex["tools"])
    theirs = hf_tokenizer.apply_chat_template(ex["messages"], tools=ex["tools"], chat_template=tpl,
                                              tokenize=False)
    assert ours == theirs and "search_recipes" in ours


def _expected_turns(name, conv, text, spans):
    """Each assistant span = the (possibly trimmed) content + a non-empty end-of-turn."""
    out = []
    for msg, (s, e) in zip([m for m in conv if m["role"] == "assistant"], spans):
        got = text[s:e]
        content = msg["content"].strip() if got.startswith(msg["content"].strip()) and not got.startswith(msg["content"]) else msg["content"]
        assert got.startswith(content), (name, got)
        eot = got[len(content):]
        assert eot.strip() and eot == eot.rstrip(), (name, got)  # an end-of-turn marker is trained
        out.append(got)
    return out


@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_spans_and_masks(name, chat_tokenizer):
    tpl, conv = ALL_TEMPLATES[name], _conv_for(name)
    r = render_with_spans(conv, tpl, bos_token="<s>", eos_token="</s>")
    assert r.text == render_chat(conv, tpl, bos_token="<s>", eos_token="</s>")
    assert len(r.assistant_spans) == 2
    turns = _expected_turns(name, conv, r.text, r.assistant_spans)
    enc = encode_example({"messages": conv}, chat_tokenizer, tpl, bos_token="<s>", eos_token="</s>",
                         train_on_responses_only=True)
    trained = [i for i in enc.labels if i != IGNORE_INDEX]
    assert chat_tokenizer.decode(trained, skip_special_tokens=False) == "".join(turns)
    assert "".join(t for t, f in enc.segments if f) == "".join(turns)
    assert "".join(t for t, _ in enc.segments) == r.text
    full = encode_example({"messages": conv}, chat_tokenizer, tpl, bos_token="<s>", eos_token="</s>",
                          train_on_responses_only=False)
    assert full.labels == full.input_ids == enc.input_ids


def test_deepseek_think_is_located():
    tpl = ALL_TEMPLATES["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"]
    conv = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"}]
    r = render_with_spans(conv, tpl, bos_token="<s>", eos_token="</s>")
    assert [r.text[s:e] for s, e in r.assistant_spans] == ["4<｜end▁of▁sentence｜>"]


def test_template_errors_are_dataset_errors():
    with pytest.raises(DatasetError, match="rejected this conversation: System role not supported"):
        render_chat(CONV, ALL_TEMPLATES["google-gemma-2-2b-it"])
    with pytest.raises(DatasetError, match="does not parse: line 1"):
        render_chat(CONV, "{% for m in messages %}")
    assert [t["name"] for t in list_default_templates()] == ["chatml", "llama3", "alpaca", "zephyr"]
    assert resolve_template("ChatML") == DEFAULT_TEMPLATES["chatml"]
    assert resolve_template(None, "{{ x }}") == "{{ x }}"


def test_text_prompt_completion_and_truncation(gpt2_tokenizer):
    eos = gpt2_tokenizer.token_to_id("<|endoftext|>")
    enc = encode_example({"text": "Once upon a time"}, gpt2_tokenizer, None, eos_token="<|endoftext|>")
    assert enc.input_ids[-1] == eos and enc.labels == enc.input_ids
    enc = encode_example({"prompt": "Q: capital of France?\nA:", "completion": " Paris"}, gpt2_tokenizer,
                         None, eos_token="<|endoftext|>")
    trained = [i for i in enc.labels if i != IGNORE_INDEX]
    assert gpt2_tokenizer.decode(trained, skip_special_tokens=False) == " Paris<|endoftext|>"
    enc = encode_example({"text": "one two three four five six"}, gpt2_tokenizer, None,
                         eos_token="<|endoftext|>", max_seq_length=3)
    assert enc.truncated and len(enc.input_ids) == 3 and enc.num_tokens == 7
    assert "".join(t for t, _ in enc.segments) == "one two three"
    with pytest.raises(DatasetError, match="no chat template; choose one of chatml"):
        encode_example({"messages": CONV}, gpt2_tokenizer, None)


def test_load_tokenizer_bundle(tmp_path, gpt2_tokenizer):
    gpt2_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|endoftext|>"}, "bos_token": "<|endoftext|>",
        "chat_template": [{"name": "default", "template": "A{{ eos_token }}"}, {"name": "rag", "template": "B"}]}))
    b = load_tokenizer_bundle(tmp_path)
    assert (b.eos_token, b.bos_token, b.chat_template, b.eos_id) == ("<|endoftext|>", "<|endoftext|>", "A{{ eos_token }}", 50256)
    (tmp_path / "chat_template.jinja").write_text("C")
    assert load_tokenizer_bundle(tmp_path).chat_template == "C"
    vm = tmp_path / "vm"
    vm.mkdir()
    (vm / "vocab.json").write_bytes((GPT2 / "gpt2_vocab.json").read_bytes())
    (vm / "merges.txt").write_bytes((GPT2 / "gpt2_merges.txt").read_bytes())
    assert load_tokenizer_bundle(vm).tokenizer.encode("hello world").ids == [31373, 995]
    with pytest.raises(DatasetError, match="no tokenizer.json"):
        load_tokenizer_bundle(tmp_path / "missing")


@pytest.mark.parametrize("rel,fmt,rows,valid", EXPECTED_ROWS)
def test_report_on_real_files(rel, fmt, rows, valid, bundle):
    rep = inspect_dataset(SHARED / rel, bundle, "chatml", max_seq_length=512, preview_rows=3)
    assert (rep.format, rep.total_rows, rep.valid_rows, rep.invalid_rows) == (fmt, rows, valid, rows - valid)
    assert sum(b.count for b in rep.histogram) == valid
    assert rep.over_max_seq_length == sum(1 for _, e in iter_encoded(
        SHARED / rel, bundle, "chatml", None, True, skip_untrained=False) if e.num_tokens > 512)
    assert len(rep.preview) == min(3, valid) and all(p.num_trained > 0 for p in rep.preview)
    json.loads(rep.model_dump_json())
    n = sum(1 for _ in iter_encoded(SHARED / rel, bundle, "chatml", 512, True))
    assert n == valid - rep.no_trained_tokens
    if fmt == "oasst_tree":
        assert rep.errors[0].field == "prompt.synthetic"
    if "dolly" in rel:
        assert rep.warning_count == 302 and rep.no_trained_tokens > 0
        assert not any("###eos_token###" in t for p in rep.preview for t, _ in p.segments)


def test_report_errors_on_messy_files(bundle):
    with pytest.raises(DatasetError) as info:
        inspect_dataset(SHARED / "messy" / "sharegpt_empty_assistant_turn.json", bundle, "chatml")
    assert (info.value.row, info.value.field) == (1, "conversations[1].value")
    assert str(info.value).startswith("row 1, field 'conversations[1].value': empty assistant turn")
    rep = inspect_dataset(SHARED / "messy" / "sharegpt_empty_assistant_turn.json", bundle, "chatml",
                          raise_if_empty=False)
    assert rep.valid_rows == 0 and rep.errors[0].row == 1
    with pytest.raises(DatasetError, match="invalid UTF-8") as info:
        inspect_dataset(SHARED / "messy" / "sms_spam_kaggle_latin1.csv", bundle, "chatml")
    assert info.value.row == 6
    with pytest.raises(DatasetError, match="need a chat template"):
        inspect_dataset(SHARED / "sft" / "identity_alpaca.json", bundle, None)


def test_preview_highlights_alpaca_response(bundle):
    rep = inspect_dataset(SHARED / "sft" / "identity_alpaca.json", bundle, "alpaca", preview_rows=1)
    data = json.loads((SHARED / "sft" / "identity_alpaca.json").read_text())
    trained = "".join(t for t, f in rep.preview[0].segments if f)
    assert trained == data[0]["output"] + "<|endoftext|>"
