"""Chat tokenizers and tiny chat models for export tests, from real files only.

Each family's tokenizer is the real GPT-2 byte-level BPE (``../shared/data/tokenizers/gpt2-bpe``)
plus that model family's real special tokens, added in the order of their ids in the real
tokenizer (so turn-START markers come before end-of-turn markers, as in Qwen2.5's
``<|im_start|>`` 151644 < ``<|im_end|>`` 151645), and, for Qwen2 and Llama 3, the real split
regex of their pre-tokenizer (the one llama.cpp selects by ``tokenizer.ggml.pre``).
"""
from __future__ import annotations

import json
from pathlib import Path

from tests.export.conftest import DATA

GPT2 = DATA / "tokenizers" / "gpt2-bpe"
TEMPLATES = DATA / "chat_templates"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

#: family -> specials (real id order), bos, eos, the end-of-turn marker, split regex
FAMILIES = {
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
              "<|object_ref_end|>", "<|box_start|>", "<|box_end|>"],
             None, "<|endoftext|>", "<|im_end|>", _QWEN2_SPLIT),
    "deepseek": (["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>",
                  "<|EOT|>"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                 "<｜end▁of▁sentence｜>", _QWEN2_SPLIT),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
               "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", _LLAMA3_SPLIT),
    "gemma": (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
              "<bos>", "<eos>", "<end_of_turn>", None),
    "phi3": (["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|system|>", "<|end|>",
              "<|user|>"], "<s>", "<|endoftext|>", "<|end|>", None),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"], "<s>", "</s>",
                "</s>", None),
    # a base model's tokenizer: none of a chat template's markers (GPT-2's own specials only)
    "gpt2": (["<|endoftext|>"], None, "<|endoftext|>", None, _QWEN2_SPLIT),
}
#: real template file -> family
TEMPLATE_FAMILY = {"Qwen-Qwen2.5-7B-Instruct": "qwen",
                   "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek",
                   "google-gemma-2-2b-it": "gemma", "meta-llama-Llama-3.1-8B-Instruct": "llama3",
                   "meta-llama-Llama-3.2-3B-Instruct": "llama3",
                   "microsoft-Phi-3.5-mini-instruct": "phi3",
                   "mistralai-Mistral-Nemo-Instruct-2407": "mistral"}


def chat_tokenizer(family: str, template: str | None = None):
    """A ``PreTrainedTokenizerFast``: real GPT-2 BPE + ``family``'s specials (see the module)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from app.data.encode import byte_level_bpe

    specials, bos, eos, _, split = FAMILIES[family]
    raw = byte_level_bpe(GPT2 / "gpt2_vocab.json", GPT2 / "gpt2_merges.txt", ())
    if split:
        raw.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raw.add_special_tokens(list(dict.fromkeys(s for s in (*specials, bos, eos) if s)))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos,
                                  pad_token=eos)
    if template:
        tok.chat_template = template
    return tok


def template_text(stem: str) -> str:
    """The real Jinja chat template ``../shared/data/chat_templates/<stem>.jinja``."""
    return (TEMPLATES / f"{stem}.jinja").read_text()


def tiny_model(arch: str, vocab_size: int, bos_id, eos_id, tied: bool = True, seed: int = 0,
               pad_id: int | None = None):
    """A random-init tiny ``Qwen2``/``Llama``/``Gemma2`` causal LM (fp32, eval mode).

    ``pad_id``: ``pad_token_id`` (its embedding row starts at zero). Give Gemma 2 the tokenizer's
    ``<pad>``: its config defaults to 0, real Gemma's ``<pad>`` but GPT-2's ``!``, whose zero row
    (tied, so also its output row) leaves ``!`` a logit of 0 that training cannot raise."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=bos_id, eos_token_id=eos_id,
                  tie_word_embeddings=tied)
    if pad_id is not None:
        common["pad_token_id"] = pad_id
    extra = {"gemma2": dict(head_dim=8, sliding_window=64, query_pre_attn_scalar=8)}.get(arch, {})
    names = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "llama": ("LlamaConfig", "LlamaForCausalLM"),
             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}[arch]
    cfg = getattr(transformers, names[0])(**common, **extra)
    cfg.architectures = [names[1]]
    return getattr(transformers, names[1])(cfg).eval()


def save_base(model, tok, folder: Path) -> Path:
    """Save ``model`` + ``tok`` as a local HF base-model folder."""
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def train_run(root: Path, template: str, stem: str, answer: str, steps: int, *, model=None,
              tok=None, new_token_ids: list[int] | None = None,
              learning_rate: float = 1e-2) -> Path:
    """Train ``root/base`` through the worker's SFT path (app.data encoding, PEFT LoRA on every
    linear layer, the CPU trainer; ``learning_rate`` constant) on six chat rows answered
    ``answer``; returns ``root/run`` (``adapter/``, ``config.json``) as the train job leaves it.

    1e-2: at 3e-2 the tiny Llama-3-style model's loss rose again after step 7 on one host's
    vector units (to 9, ending at 2.2 after 30 steps: it answered 'HelloTYTY') while it
    converged on others; new tokens' rows (``new_token_ids``) need the faster rate.

    ``model``/``tok``: a loaded base and tokenizer to train instead of the folder's (e.g. with
    tokens added, :mod:`worker.engine.new_tokens`; ``tok`` is then saved with the adapter and
    encodes the data); ``new_token_ids``: rows trained with ``trainable_token_indices``."""
    from app.store.specs import TrainSpec
    from worker.engine import data as edata
    from worker.engine import sft

    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]}
            for q in ("Hi", "Hello?", "Good morning", "Hey you", "Who are you?", "Say hi")]
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = TrainSpec.model_validate(dict(
        model="tiny", dataset="chat", r=8, lora_alpha=16, lora_dropout=0.0, learning_rate=learning_rate,
        max_steps=steps, per_device_train_batch_size=6, warmup_ratio=0.0,
        lr_scheduler_type="constant", max_seq_length=256, save_steps=1000,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    encode_dir = root / "base"
    if tok is not None:
        encode_dir = root / "tokenizer"
        tok.save_pretrained(encode_dir)
    enc = edata.build_dataset(data, encode_dir, template, 256, True)
    model = model if model is not None else sft.load_model(str(root / "base"), False, False)
    model = sft.add_lora(model, spec, new_token_ids=new_token_ids)
    args = sft.sft_config(spec, str(root / "run" / "checkpoints"), False, "adamw_torch")
    trainer = sft.make_trainer(model, tok or sft.load_tokenizer(str(root / "base"), template),
                               enc.dataset, args)
    trainer.train()
    trainer.save_model(str(root / "run" / "adapter"))
    if tok is not None:
        tok.save_pretrained(root / "run" / "adapter")  # as the train job saves it
    (root / "run" / "config.json").write_text(json.dumps({
        "spec": spec.model_dump(mode="json"), "model": {"path": str(root / "base")},
        "dataset": {"path": str(data)}, "chat_template": {"name": stem, "template": template}}))
    return root / "run"


def llama_greedy(llm, ids: list[int], limit: int = 20) -> list[int]:
    """Greedy tokens of a ``llama_cpp.Llama`` after ``ids``, up to and including the first
    end-of-generation token of its vocabulary (at most ``limit``)."""
    from llama_cpp import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out: list[int] = []
    for t in llm.generate(ids, temp=0.0, top_k=1):
        out.append(t)
        if llama_cpp.llama_vocab_is_eog(vocab, t) or len(out) == limit:
            break
    return out
