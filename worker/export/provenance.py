"""What an export was made from: the base model, the adapter and which base weights were merged.

:func:`provenance` returns a JSON-able dict (stored in the export job's result, shown by
``GET /api/exports/{id}``); :func:`write_merged_provenance` records it in a merged folder's
``config.json`` (key ``merged_from``) and a model card ``README.md`` whose front matter names the
base with the Hugging Face ``base_model`` field.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .run import RunInfo


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def provenance(info: RunInfo, base: dict | None = None, run_id: str | None = None) -> dict:
    """``{"base_model", "base_model_revision", "base_model_name", "base_model_source",
    "base_weights", "adapter": {"run_id", "sha256", "r", "lora_alpha", "target_modules"}}``.

    ``base`` is the model row (``name``, ``source`` hf|local|llama2c, ``source_ref``: a Hub id
    optionally ``id@revision``, a folder, or a llama2.c checkpoint). ``base_model`` is the base's
    public id, never a server path: the Hub id for a Hub model, else the model's name (without
    ``base``, the base folder's name), the name the adapter export's card gives too.
    ``base_weights`` says what the delta was added to: the base's stored weights
    (``"float32"``, ``"bfloat16"``...) or ``"nf4-dequantized"`` for a QLoRA run.
    """
    base = base or {}
    source, name = base.get("source"), base.get("name") or info.base_dir.name
    hub_id, _, revision = (base.get("source_ref") or name).partition("@") if source == "hf" \
        else (name, "", "")
    cfg_p = info.base_dir / "config.json"
    cfg = json.loads(cfg_p.read_text()) if cfg_p.is_file() else {}
    stored = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    acfg = json.loads((info.adapter_dir / "adapter_config.json").read_text())
    targets = acfg.get("target_modules")
    return {"base_model": hub_id, "base_model_revision": revision or None,
            "base_model_name": name,
            "base_model_source": source or "local",
            "base_weights": "nf4-dequantized" if info.load_in_4bit else stored,
            "adapter": {"run_id": run_id or info.run_dir.name,
                        "sha256": _sha256(info.adapter_dir / "adapter_model.safetensors"),
                        "r": acfg.get("r"), "lora_alpha": acfg.get("lora_alpha"),
                        "target_modules": sorted(targets) if isinstance(targets, list)
                        else targets}}


def write_merged_provenance(folder: Path, prov: dict, dtype: str, why: str | None = None) -> None:
    """Add ``merged_from`` to ``folder/config.json`` and write the model card ``README.md``,
    which says the weights are saved as ``dtype`` (``float32``...) and ``why`` (a clause)."""
    cfg_p = folder / "config.json"
    cfg = json.loads(cfg_p.read_text())
    cfg["merged_from"] = prov
    cfg_p.write_text(json.dumps(cfg, indent=2))
    a = prov["adapter"]
    weights = ("the NF4-dequantised base (the weights the QLoRA run trained against)"
               if prov["base_weights"] == "nf4-dequantized"
               else f"the base's stored {prov['base_weights']} weights")
    rev = f" at revision `{prov['base_model_revision']}`" if prov["base_model_revision"] else ""
    front = ["---", f"base_model: {json.dumps(prov['base_model'])}", "library_name: transformers",
             "tags: [whetstone, lora, merged]", "---", ""]
    body = [f"# {prov['base_model_name']} + LoRA (run `{a['run_id']}`), merged",
            "", f"Base model: `{prov['base_model']}`{rev} ({prov['base_model_source']}).",
            f"Adapter: run `{a['run_id']}`, r={a['r']}, lora_alpha={a['lora_alpha']}, "
            f"target modules {a['target_modules']}, adapter_model.safetensors sha256 "
            f"`{a['sha256']}`.",
            f"Merged into {weights}; saved as {dtype}" + (f" ({why})." if why else "."), ""]
    (folder / "README.md").write_text("\n".join(front + body), encoding="utf-8")
