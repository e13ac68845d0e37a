"""Facts read from a model folder without loading the model (web and worker, no torch).

:func:`missing_targets` checks LoRA ``target_modules`` against the weight names in the
safetensors index or headers, so a typo is a field error at creation, not a worker failure.
:func:`context_length` is the model's context window in tokens (``max_position_embeddings``, or a
multimodal config's ``text_config`` entry), None when the folder or field is missing. A GRPO
prompt plus completion longer than it is refused (:func:`app.studio.seqlen.fit_grpo_lengths`).
An SFT ``max_seq_length`` past it is refused at creation
(:func:`app.studio.seqlen.fit_max_seq_length`); the job warns of it in the run log
(:func:`seq_longer_than_context`).
"""
from __future__ import annotations

import json
from pathlib import Path


def context_length(model_dir: str | Path | None) -> int | None:
    """``max_position_embeddings`` of the HF model in ``model_dir`` (tokens), or None."""
    if not model_dir:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}):
        n = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(n, int) and n > 0:
            return n
    return None


def seq_longer_than_context(max_seq_length: int, model_dir, model_name: str) -> str | None:
    """A warning when an SFT run's ``max_seq_length`` (tokens) exceeds the model's context window
    (``max_position_embeddings``), else None: rows longer than the window train on positions the
    model was never trained at (RoPE extrapolates them; nothing fails, quality may)."""
    n = context_length(model_dir)
    if n is not None and max_seq_length > n:
        return (f"max_seq_length {max_seq_length} is longer than {model_name}'s context window "
                f"({n} tokens, max_position_embeddings): rows past {n} tokens train on positions "
                f"the model never saw; {n} or less keeps them inside it")
    return None


def weight_names(model_dir: str | Path | None) -> list[str] | None:
    """Tensor names of the model's safetensors weights (``model.safetensors.index.json``'s
    weight map, else the JSON header of each ``*.safetensors`` file), None when unreadable."""
    if not model_dir:
        return None
    folder = Path(model_dir)
    try:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return list(json.loads(index.read_text())["weight_map"])
        names: list[str] = []
        files = sorted(folder.glob("*.safetensors"))
        for f in files:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if not 0 < size < 100 << 20:
                    return None
                names += [k for k in json.loads(fh.read(size)) if k != "__metadata__"]
        return names or None
    except (OSError, ValueError, KeyError):
        return None


def missing_targets(target_modules: list[str], model_dir, model_name: str) -> str | None:
    """Why LoRA ``target_modules`` (PEFT's names: a module name suffix, e.g. ``q_proj``) match no
    linear weight of the model, else None (also None when the weights cannot be read)."""
    names = weight_names(model_dir)
    if not names:
        return None
    modules = {n.rsplit(".", 1)[0] for n in names if n.endswith(".weight")}
    leaves = sorted({leaf for m in modules if "layers." in m or "h." in m
                     for leaf in [m.rsplit(".", 1)[-1]] if "norm" not in leaf})
    unknown = [t for t in target_modules
               if not any(m == t or m.endswith("." + t) for m in modules)]
    if not unknown:
        return None
    return (f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a module of "
            f"{model_name}; its layers have: {', '.join(leaves) or '(none found)'}")
