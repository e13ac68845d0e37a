"""What travels with a downloaded adapter: a portable ``adapter_config.json`` and a model card.

PEFT writes ``base_model_name_or_path`` as the folder the base was loaded from, which for the
studio is an absolute path inside its data dir: useless (and revealing) anywhere else. The
adapter names its base the way others can load it instead: the Hugging Face id when the model
came from the Hub, else the model's registered name (the llama2.c demo model: ``stories260K``,
converted from ``karpathy/tinyllamas``). ``README.md`` is a model card in the Hub's format
(YAML front matter, then prose): base, data, settings, metrics, chat template, versions.
"""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from app.store.schema import Model
from app.studio.artifacts import base_model_id, portable_text

#: Where models registered from llama2.c checkpoints come from (the demo model's origin).
LLAMA2C_ORIGIN = "karpathy/tinyllamas"
#: Spec fields a model card lists under "Training settings", in this order.
CARD_SETTINGS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "load_in_4bit",
                 "learning_rate", "lr_scheduler_type", "warmup_ratio", "max_steps",
                 "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "max_seq_length", "packing", "padding_free", "train_on_responses_only", "num_generations", "beta",
                 "max_completion_length", "seed")


def studio_version() -> str:
    """The installed Whetstone version (``0+unknown`` when not installed as a package)."""
    try:
        return metadata.version("whetstone")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def make_portable(adapter_dir: Path, model: Model) -> None:
    """Rewrite ``adapter_config.json`` so that ``base_model_name_or_path`` is
    :func:`base_model_id` (PEFT wrote the local folder), and the model card ``README.md`` PEFT
    writes into a checkpoint (``base_model: <folder>``, tag ``base_model:adapter:<folder>``)
    the same way (:func:`app.studio.artifacts.portable_text`). Raises OSError/ValueError on a
    missing or unreadable config."""
    path = adapter_dir / "adapter_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    local = cfg.get("base_model_name_or_path")
    cfg["base_model_name_or_path"] = base_model_id(model)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True), encoding="utf-8")
    card = adapter_dir / "README.md"
    if isinstance(local, str) and card.is_file():
        text = card.read_text(encoding="utf-8")
        new = portable_text(text, [local], base_model_id(model))
        if new != text:
            card.write_text(new, encoding="utf-8")


def model_card(model: Model, run_id: str, run_name: str | None, kind: str, spec: dict[str, Any],
               dataset: dict[str, Any], template_name: str | None, metrics: dict[str, Any],
               versions: dict[str, str]) -> str:
    """The adapter's ``README.md``: a Hub-style card (front matter: base_model, library_name,
    tags) and sections for the base, the data, the settings, the metrics and how to load it.

    Args:
        kind: ``sft`` or ``grpo``.
        dataset: ``filename``, ``rows`` (and optionally ``format``, ``tokens``).
        metrics: final figures (e.g. ``final_loss`` or ``last_rewards_mean``), None values dropped.
        versions: library versions (torch, transformers, peft, trl, ...).
    """
    base = base_model_id(model)
    origin = (f" (converted from the llama2.c checkpoint of `{LLAMA2C_ORIGIN}`)"
              if model.source == "llama2c" and model.name == "stories260K" else "")
    settings = [f"- `{k}`: `{json.dumps(spec[k])}`" for k in CARD_SETTINGS if k in spec]
    shown = [f"- {k}: {v:.6g}" if isinstance(v, float) else f"- {k}: {v}"
             for k, v in metrics.items() if v is not None]
    method = "GRPO (TRL's GRPOTrainer)" if kind == "grpo" else "supervised fine-tuning (TRL's SFTTrainer)"
    data = f"`{dataset.get('filename')}`, {dataset.get('rows')} rows"
    if dataset.get("format"):
        data += f" ({dataset['format']})"
    lines = [
        "---", f"base_model: {base}", "library_name: peft",
        "tags: [whetstone, lora, " + ("grpo" if kind == "grpo" else "sft") + "]", "---", "",
        f"# {run_name or run_id}", "",
        f"A LoRA adapter for `{base}`{origin}, trained with {method} in Whetstone "
        f"{studio_version()} (run `{run_id}`).", "",
        "## Data", "", data, "",
        "## Chat template", "",
        f"`{template_name or 'none'}` (saved beside the adapter as `chat_template.jinja` when "
        "there is one)", "",
        *(["The template's special tokens the base lacked were added (`add_template_tokens`): "
           "the tokenizer here has them, the adapter holds their embedding rows "
           "(`trainable_token_indices`), and the base must be resized to the tokenizer "
           "(`AutoPeftModelForCausalLM` does it).", ""] if spec.get("add_template_tokens") else []),
        "## Training settings", "", *settings, "",
        "## Results", "", *(shown or ["- (none recorded)"]), "",
        "## Use", "", "```python", "from peft import AutoPeftModelForCausalLM",
        'model = AutoPeftModelForCausalLM.from_pretrained("path/to/this/folder")', "```",
        f"The base is loaded as `{base}`; point `base_model_name_or_path` in "
        "`adapter_config.json` at a local copy if it is not on the Hub.", "",
        "## Versions", "", *[f"- {k} {v}" for k, v in sorted(versions.items())], "",
    ]
    return "\n".join(lines)
