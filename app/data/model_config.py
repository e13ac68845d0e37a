"""Facts read from a model folder's ``config.json`` without loading the model (web and worker).

:func:`context_length` is the model's context window in tokens (``max_position_embeddings``, or a
multimodal config's ``text_config`` entry), None when the folder or field is missing. A GRPO
completion longer than it cannot be generated sensibly (positions past the window), so the web
refuses such a run and the worker re-checks it when the model was not ready at creation.
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


def completion_too_long(max_completion_length: int, model_dir, model_name: str) -> str | None:
    """Why a GRPO run's ``max_completion_length`` cannot fit the model's context, else None."""
    n = context_length(model_dir)
    if n is not None and max_completion_length > n:
        return (f"{max_completion_length} tokens is longer than {model_name}'s context window "
                f"({n} tokens, max_position_embeddings); use at most {n}")
    return None
