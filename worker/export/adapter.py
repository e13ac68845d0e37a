"""Adapter export: the PEFT LoRA adapter with the tokenizer and chat template beside it.

Layout (what ``PeftModel.from_pretrained(base, folder)`` reads): ``adapter_config.json``,
``adapter_model.safetensors``; plus ``tokenizer.json``/``tokenizer_config.json`` (saved by
the run's tokenizer, chat template included) and ``chat_template.jinja``. The copy is checked
by loading it with peft: the config parses and the safetensors keys match the LoRA modules
peft expects (a quick load onto the base happens in :mod:`worker.export.verify`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .files import ExportError, ProgressFn, atomic_path, noop_progress
from .run import RunInfo, load_tokenizer

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin",
                 "README.md")


def check_adapter(folder: Path) -> dict:
    """Load ``folder`` with peft (config + weights); returns ``{"peft_type", "r", "tensors"}``."""
    from peft import PeftConfig
    from safetensors import safe_open

    cfg = PeftConfig.from_pretrained(folder)
    weights = folder / "adapter_model.safetensors"
    if not weights.exists():
        raise ExportError(f"{folder}: adapter_model.safetensors is missing")
    with safe_open(weights, "pt") as f:
        keys = list(f.keys())
    if not any("lora_A" in k for k in keys) or not any("lora_B" in k for k in keys):
        raise ExportError(f"{weights}: no lora_A/lora_B tensors")
    return {"peft_type": str(cfg.peft_type.value if hasattr(cfg.peft_type, "value")
                             else cfg.peft_type), "r": getattr(cfg, "r", None),
            "tensors": len(keys)}


def export_adapter(info: RunInfo, out_dir: str | Path,
                   progress: ProgressFn = noop_progress) -> dict:
    """Copy the adapter, tokenizer and chat template to ``out_dir`` (atomically)."""
    progress("copy", 0.1)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        for name in ADAPTER_FILES:
            if (info.adapter_dir / name).exists():
                shutil.copy2(info.adapter_dir / name, tmp / name)
        load_tokenizer(info).save_pretrained(tmp)
        if info.chat_template:
            (tmp / "chat_template.jinja").write_text(info.chat_template)
        checked = check_adapter(tmp)
    progress("copy", 1.0)
    return {"path": str(out_dir), **checked}
