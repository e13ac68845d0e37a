"""Sampling as HF's ``generate`` does it, for the engine's decoder (worker.engine.decode).

:func:`resolve_config` gives the GenerationConfig HF would use (the caller's, with the model's and
the global defaults filled in: TRL leaves ``top_k`` None and HF then uses 50). :func:`warp` applies
HF's processors in HF's order to fp32 logits [B, V] (:func:`min_length_mask` first: EOS
suppressed until ``min_length`` / ``min_new_tokens``): repetition penalty, then (``do_sample``)
temperature, top-k, top-p, min-p; :func:`sample` draws with ``torch.multinomial`` or takes the
argmax. :data:`NEUTRAL` lists the options this path does not implement with their neutral values.
Source: transformers' ``generation/logits_process.py`` semantics (checked in tests/engine).
"""
from __future__ import annotations

import torch

#: Generation options this path does not implement, with their neutral values (after HF's merge of
#: the model's and the global defaults): any other value sends the call to HF's ``generate``.
NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "no_repeat_ngram_size": 0,
           "bad_words_ids": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
           "suppress_tokens": None, "begin_suppress_tokens": None, "typical_p": 1.0,
           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "exponential_decay_length_penalty": None,
           "top_h": None, "remove_invalid_values": False,
           "sequence_bias": None, "renormalize_logits": False, "guidance_scale": None,
           "watermarking_config": None, "output_scores": False, "output_logits": False,
           "return_dict_in_generate": False, "stop_strings": None, "max_time": None,
           "output_attentions": False, "output_hidden_states": False, "diversity_penalty": 0.0,
           "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
           "prompt_lookup_num_tokens": None, "assistant_model": None}


def resolve_config(model, generation_config, **kwargs):
    """The GenerationConfig HF's ``generate`` would use: the given one with the model's and the
    global defaults filled in (e.g. ``top_k`` 50 when the caller left it None), then ``kwargs``
    that name generation options (``max_new_tokens=...``), as HF does. Raises ValueError naming
    any other keyword (a model input or a ``generate()`` argument such as ``streamer``)."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg, rest = hf._prepare_generation_config(generation_config, **kwargs)
    if rest:
        raise ValueError(f"generate() arguments {sorted(rest)}")
    return cfg


def _eos_ids(cfg):
    e = getattr(cfg, "eos_token_id", None)
    return [] if e is None else ([e] if isinstance(e, int) else list(e))


_EOS_INDEX: dict = {}


def _eos_index(eos: list, device) -> torch.Tensor:
    """The EOS ids as an index tensor on ``device``, made once per (device, ids): indexing with a
    host list copies it from pageable memory every call, which waits for the GPU each token."""
    key = (str(device), tuple(eos))
    if key not in _EOS_INDEX:
        _EOS_INDEX[key] = torch.tensor(eos, dtype=torch.long, device=device)
    return _EOS_INDEX[key]


def min_length_mask(logits, cfg, cur_len: int, new_len: int):
    """HF's MinLength and MinNewTokensLength processors on fp32 logits [B, V]: while the ids so far
    number fewer than ``min_length`` (``cur_len`` counts the padded prompt) or the generated tokens
    ``new_len`` fewer than ``min_new_tokens``, every EOS id's logit becomes -inf."""
    eos = [e for e in _eos_ids(cfg) if 0 <= e < logits.shape[-1]]
    if eos and (cur_len < (getattr(cfg, "min_length", None) or 0)
                or new_len < (getattr(cfg, "min_new_tokens", None) or 0)):
        logits = logits.clone()
        logits[:, _eos_index(eos, logits.device)] = float("-inf")
    return logits


def warp(logits, ids, cfg):
    """HF's processors on fp32 logits [B, V] given the ids so far [B, n]: repetition penalty,
    then (``do_sample``) temperature, top-k, top-p, min-p; removed tokens become -inf."""
    rp = getattr(cfg, "repetition_penalty", None)
    if rp is not None and rp != 1.0:
        got = logits.gather(1, ids)
        logits = logits.scatter(1, ids, torch.where(got < 0, got * rp, got / rp))
    if not getattr(cfg, "do_sample", False):
        return logits
    t = getattr(cfg, "temperature", None)
    if t is not None and t != 1.0:
        logits = logits / t
    k = getattr(cfg, "top_k", None)
    if k is not None and 0 < k < logits.shape[-1]:
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = getattr(cfg, "top_p", None)
    if p is not None and p < 1.0:
        srt, idx = torch.sort(logits, descending=False)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= (1 - p)
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    mp = getattr(cfg, "min_p", None)
    if mp is not None and mp > 0:
        probs = logits.softmax(-1)
        drop = probs < mp * probs.max(-1, keepdim=True).values
        drop &= ~(logits == logits.max(-1, keepdim=True).values)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits, ids, cfg, generator=None, new_len: int | None = None):
    """Next token ids [B]: argmax, or a draw from softmax(:func:`warp`) when ``do_sample``;
    ``new_len`` (tokens generated so far) applies :func:`min_length_mask` first."""
    if new_len is not None:
        logits = min_length_mask(logits, cfg, ids.shape[1], new_len)
    logits = warp(logits, ids, cfg)
    if not getattr(cfg, "do_sample", False):
        return logits.argmax(-1)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
