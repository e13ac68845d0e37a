"""The attention implementation transformers must use for a model to compute it as defined.

Gemma 2 soft-caps its attention scores: ``s -> c * tanh(s / c)`` with ``c =
attn_logit_softcapping`` (50 in Google's configs). In transformers 5 only the ``eager``
attention applies the cap; ``sdpa`` (the default) and flash-attention accept the ``softcap``
argument and ignore it. A Gemma 2 loaded the default way is therefore another model than the
one its weights were trained as, than our CUDA engine computes (``worker/engine/attention.py``
caps the scores) and than llama.cpp runs from a GGUF (``gemma2.attn_logit_softcapping``).
Measured on a tiny trained Gemma 2 (tests/export/test_chat_trained.py): sdpa logits differ
from eager ones by 1.8e-2 x |top logit|; an F32 GGUF differs from eager by 2.3e-4 x |top logit|.

Every place that loads such a model with transformers for training (CPU path), as the export
verification's reference or to check a merged export passes :func:`attn_kwargs`.
"""
from __future__ import annotations

import json
from pathlib import Path


def softcaps_attention(config) -> bool:
    """Whether a config (a transformers config, or ``config.json`` as a dict) soft-caps its
    attention scores (``attn_logit_softcapping`` set, on it or its ``text_config``)."""
    if isinstance(config, dict):
        text = config.get("text_config") or {}
        return bool(config.get("attn_logit_softcapping") or text.get("attn_logit_softcapping"))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "attn_logit_softcapping", None)
                or getattr(text, "attn_logit_softcapping", None))


def attn_kwargs(model_dir: str | Path) -> dict:
    """``from_pretrained`` keyword arguments for the model folder ``model_dir``:
    ``{"attn_implementation": "eager"}`` when its ``config.json`` soft-caps attention (see the
    module docstring), else ``{}`` (transformers' default). A folder without a readable
    ``config.json`` gets ``{}``."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"attn_implementation": "eager"} if softcaps_attention(cfg) else {}
