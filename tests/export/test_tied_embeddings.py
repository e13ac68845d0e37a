"""A tied-embedding Qwen2 with LoRA on ``embed_tokens`` (real GPT-2 BPE + Qwen2.5's specials and
real template): the export must equal base + adapter as PEFT computes it (trained embedding on
the input side, base matrix as the head), so it is untied; a merge that keeps the trained
embedding as the head must fail verification."""
from __future__ import annotations

import json

import pytest

from tests.export.chat_models import chat_tokenizer, save_base, template_text, tiny_model
from tests.export.conftest import DATA, need_data
from worker.export.quantize import llama_cpp_available

QWEN = "Qwen-Qwen2.5-7B-Instruct"
SFT = DATA / "sft" / "oasst1_en_100_messages.jsonl"


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    """(run folder, base folder, tokenizer): LoRA on embed_tokens + q_proj, random A and B."""
    need_data()
    import torch
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("tied")
    template = template_text(QWEN)
    tok = chat_tokenizer("qwen", template)
    base = tiny_model("qwen2", len(tok), None, tok.eos_token_id, tied=True)
    save_base(base, tok, root / "base")
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8,
                                           target_modules=["embed_tokens", "q_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.3)
    peft.save_pretrained(root / "run" / "adapter")
    (root / "run" / "config.json").write_text(json.dumps({
        "model": {"path": str(root / "base")}, "chat_template": {"name": "qwen",
                                                                "template": template},
        "spec": {"load_in_4bit": False}, "dataset": {"path": str(SFT)}}))
    return root / "run", root / "base", tok


BASE = {"name": "tiny-qwen", "source": "hf", "source_ref": "Qwen/Qwen2.5-0.5B@7ae5576"}


def _export(run, fmt, tmp_path, **kw):
    from worker.jobs.export import export_run

    return export_run(run, {"run_id": "r", "format": fmt, **kw}, tmp_path, name="m", base=BASE)


def test_merged_is_untied_and_equals_peft(tied_run, tmp_path):
    run, _, tok = tied_run
    res = _export(run, "merged_16bit", tmp_path, dtype="fp32")
    check = res["verification"]["checks"]["merged"]
    assert res["verification"]["passed"] and "logits" in check["checks"], check
    assert check["max_logit_error"] < 1e-4
    folder = tmp_path / "merged-fp32"
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    assert res["merged"]["untied"] is True
    from safetensors import safe_open
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())
        assert (f.get_tensor("lm_head.weight") - f.get_tensor("model.embed_tokens.weight")
                ).abs().max() > 0.1
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>"
    gen = json.loads((folder / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    prov = json.loads((folder / "config.json").read_text())["merged_from"]
    assert prov == res["provenance"]
    assert (prov["base_model"], prov["base_model_revision"], prov["base_weights"]) == (
        "Qwen/Qwen2.5-0.5B", "7ae5576", "float32")
    assert prov["adapter"]["target_modules"] == ["embed_tokens", "q_proj"]
    assert len(prov["adapter"]["sha256"]) == 64
    card = (folder / "README.md").read_text()
    assert 'base_model: "Qwen/Qwen2.5-0.5B"' in card and "revision `7ae5576`" in card


def test_wrong_merge_fails_verification(tied_run, tmp_path, monkeypatch):
    """The old merge (trained embedding reused as the head) must not pass."""
    from worker.export import merged as M
    from worker.jobs.export import VerificationFailed

    def naive(model):
        out = model.merge_and_unload()
        out.get_output_embeddings().weight = out.get_input_embeddings().weight
        M._set_tied(out.config, True)
        return out, False

    monkeypatch.setattr(M, "merge_adapter", naive)
    with pytest.raises(VerificationFailed) as e:
        _export(tied_run[0], "merged_16bit", tmp_path, dtype="fp32")
    fails = e.value.result["verification"]["checks"]["merged"]["failures"]
    assert any(f["check"] == "logits" and f["max_logit_error"] > 0.1 for f in fails), fails


@pytest.mark.skipif(llama_cpp_available() is not None, reason=str(llama_cpp_available()))
def test_gguf_writes_output_and_end_of_turn(tied_run, tmp_path):
    from gguf import GGUFReader

    run, _, tok = tied_run
    res = _export(run, "gguf", tmp_path, quantization=["F32", "F16"])
    assert res["verification"]["passed"], res["verification"]
    for q, tol in (("F32", 1e-3), ("F16", 2e-2)):
        assert res["verification"]["checks"][f"gguf_{q}"]["max_logit_error"] < tol
    r = GGUFReader(str(tmp_path / "m-F32.gguf"))
    assert "output.weight" in {t.name for t in r.tensors}
    eot = r.fields["tokenizer.ggml.eot_token_id"]
    assert int(eot.parts[eot.data[0]][0]) == tok.convert_tokens_to_ids("<|im_end|>")
    from llama_cpp import Llama, llama_cpp
    llm = Llama(model_path=str(tmp_path / "m-F32.gguf"), n_ctx=32, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert llama_cpp.llama_vocab_is_eog(vocab, tok.convert_tokens_to_ids("<|im_end|>"))
    assert not llama_cpp.llama_vocab_is_eog(vocab, tok.convert_tokens_to_ids("<|im_start|>"))
