"""What an export reads from a finished run, and how the trained model is rebuilt from it.

A run folder (written by ``worker/jobs/train.py``) holds::

    runs/<run_id>/adapter/      PEFT layout: adapter_config.json, adapter_model.safetensors
                                (tokenizer files beside them when training saved them)
    runs/<run_id>/config.json   {"spec": resolved TrainSpec (system_prompt, load_in_4bit...),
                                 "model": {"path"}, "dataset": {"path"},
                                 "chat_template": {"name", "template"}}

The base model is a local Hugging Face folder (``Model.path``); it is passed in explicitly, or
taken from ``config.json`` (``model_path``/``base_model_path``) or the adapter's
``base_model_name_or_path``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .files import ExportError


@dataclass
class RunInfo:
    """Everything an exporter needs to know about a run."""

    run_dir: Path
    adapter_dir: Path
    base_dir: Path
    chat_template: str | None
    system_prompt: str | None
    load_in_4bit: bool
    config: dict = field(default_factory=dict)

    @property
    def tokenizer_dir(self) -> Path:
        """The adapter folder when training saved a tokenizer there, else the base folder."""
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            if (self.adapter_dir / name).exists():
                return self.adapter_dir
        return self.base_dir


def load_run(run_dir: str | Path, base_dir: str | Path | None = None,
             run_spec: dict | None = None, checkpoint_step: int | None = None) -> RunInfo:
    """Read a run folder; raises :class:`ExportError` naming what is missing.

    ``checkpoint_step``: the adapter is that trainer checkpoint's
    (``checkpoints/checkpoint-<step>``, which holds ``adapter_model.safetensors`` and
    ``adapter_config.json`` of the PEFT model) instead of the final ``adapter/``: how a
    cancelled or failed run is exported.

    ``run_spec`` is the run row's spec (the worker's export job passes it, with ``base_dir`` from
    the model row): its resolved chat template, system prompt and ``load_in_4bit`` are used as
    they are. Without it (a run folder exported on its own, or a run created before runs stored
    their resolved template) they are read from ``config.json``.
    """
    run_dir = Path(run_dir)
    adapter = run_dir / "adapter"
    if checkpoint_step is not None:
        from worker.checkpoints import is_complete

        adapter = run_dir / "checkpoints" / f"checkpoint-{checkpoint_step}"
        if not is_complete(adapter) or not (adapter / "adapter_config.json").exists():
            raise ExportError(f"checkpoint {checkpoint_step} of the run is missing or incomplete "
                              "(the trainer keeps only its newest checkpoints)")
    if not (adapter / "adapter_config.json").exists():
        raise ExportError(f"{adapter}: no adapter_config.json; has the run finished training?")
    cfg_path = run_dir / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    spec = cfg.get("spec", cfg) if isinstance(cfg.get("spec"), dict) else cfg
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    if base_dir is None:  # train.py writes {"model": {"path": ...}}
        base_dir = (model.get("path") or cfg.get("model_path") or cfg.get("base_model_path")
                    or acfg.get("base_model_name_or_path"))
    if not base_dir or not Path(base_dir).is_dir():
        raise ExportError(f"base model folder {base_dir!r} not found; pass the model's path")
    if run_spec is not None and run_spec.get("chat_template_name"):
        return RunInfo(run_dir=run_dir, adapter_dir=adapter, base_dir=Path(base_dir),
                       chat_template=run_spec.get("chat_template"),
                       system_prompt=run_spec.get("system_prompt"),
                       load_in_4bit=bool(run_spec.get("load_in_4bit")), config=cfg)
    ct = cfg.get("chat_template")  # train.py: {"name", "template"}; else a Jinja string / name
    template = ct.get("template") if isinstance(ct, dict) else (ct or spec.get("chat_template"))
    if not template and (adapter / "chat_template.jinja").exists():
        template = (adapter / "chat_template.jinja").read_text(encoding="utf-8")
    if template and "{%" not in template and "{{" not in template:
        from app.data.chat_template import resolve_template

        template = resolve_template(template)
    return RunInfo(run_dir=run_dir, adapter_dir=adapter, base_dir=Path(base_dir),
                   chat_template=template, system_prompt=spec.get("system_prompt"),
                   load_in_4bit=bool(spec.get("load_in_4bit")), config=cfg)


def load_tokenizer(info: RunInfo):
    """The run's tokenizer, with its chat template set to the one training used."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(info.tokenizer_dir)
    if info.chat_template:
        tok.chat_template = info.chat_template
    return tok


def load_base(info: RunInfo, dtype=None):
    """The base as the run's adapter expects it: Gemma 2 with eager attention
    (:mod:`worker.hf_attention`: sdpa drops its soft-cap), the embedding grown to the run's
    tokenizer when training added tokens (:mod:`worker.engine.new_tokens`; the adapter sets
    those rows) and the NF4 round trip when the run was QLoRA."""
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.new_tokens import resize_to_tokenizer
    from worker.hf_attention import attn_kwargs

    from .merged import dequantized_base_

    base = AutoModelForCausalLM.from_pretrained(info.base_dir, dtype=dtype or torch.float32,
                                                **attn_kwargs(info.base_dir))
    resize_to_tokenizer(base, len(load_tokenizer(info)))
    if info.load_in_4bit:
        dequantized_base_(base)
    return base


def load_trained_model(info: RunInfo, dtype=None):
    """:func:`load_base` + the run's adapter, unmerged, in eval mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(info, dtype), info.adapter_dir).eval()
