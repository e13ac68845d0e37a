"""Llama/Mistral/Qwen2/Qwen3/Gemma/Gemma2 GGUFs (F32) give the same logits in llama.cpp as the
HF model in transformers. Tiny random models (no downloads) share stories260K's tokenizer."""
from __future__ import annotations

import pytest

from worker.export.quantize import llama_cpp_available

NO_LLAMA = llama_cpp_available()
pytestmark = pytest.mark.skipif(NO_LLAMA is not None, reason=str(NO_LLAMA))
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    # eager: transformers' sdpa drops Gemma 2's attention soft-cap, llama.cpp applies it
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=64,
                                                         query_pre_attn_scalar=16,
                                                         attn_implementation="eager")),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, stories_hf, tmp_path):
    import numpy as np
    import torch
    import transformers
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from worker.export.gguf_writer import write_gguf

    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    cfg.architectures = [model_cls]
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    tok = AutoTokenizer.from_pretrained(stories_hf)
    write_gguf(model.state_dict(), model.config, tok, tmp_path / "m.gguf", "F32",
               tokenizer_dir=stories_hf)
    ids = tok("Once upon a time there was a dog")["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float().numpy()
    llm = Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=64, logits_all=True, verbose=False,
                n_threads=2)
    llm.eval(ids)
    got = np.asarray(llm.scores[:len(ids)])
    assert np.abs(got - want).max() < 2e-3 * max(1.0, np.abs(want).max()), arch
