"""Fixtures: the real stories260K (llama2.c) converted to HF, and a run folder with a LoRA
adapter whose B matrices are random (non-zero delta), as training would leave it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA as DATA
from tests.conftest import STORIES, need_shared_data  # noqa: F401 (re-exported to tests)

#: A small chat template (the stories model has no chat template of its own); ``</s>`` ends a turn.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
            "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n{% else %}Assistant: "
            "{{ m['content'] }}</s>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")


need_data = need_shared_data


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory, stories_hf) -> Path:
    """runs/<id>/ with adapter/ (PEFT layout, random non-zero B) and config.json."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    run = tmp_path_factory.mktemp("run")
    base = AutoModelForCausalLM.from_pretrained(stories_hf, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    model.save_pretrained(run / "adapter")
    (run / "config.json").write_text(json.dumps({
        "model": "stories260K", "model_path": str(stories_hf), "chat_template": TEMPLATE,
        "system_prompt": "Tell a story.", "load_in_4bit": False, "r": 4, "lora_alpha": 8,
        "dataset_path": str(DATA / "pretrain_text" / "tinystories_sample_endoftext.txt")}))
    return run
