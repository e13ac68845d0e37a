"""Per-token log-probabilities (and entropies) of a causal LM's own tokens, for GRPO.

:func:`policy_logps` is what the GRPO trainer's policy, old-policy and reference (adapter disabled)
passes call. For input_ids / attention_mask [B, S] (left-padded prompt + right-padded completion)
and ``logits_to_keep`` = K, it returns log p(token_t | tokens_<t) / temperature-scaled for the last K
positions, [B, K] fp32, 0 where attention_mask is 0, and optionally the entropies [B, K].

* With the kernel engine patched on the model (:func:`worker.engine.engine.engine_state`), the
  hidden states come from :func:`worker.engine.engine.hidden_states`: the fused decoder layers
  (LoRA ops with hand-written backward, NF4 dequantised on the fly, per-layer checkpointing). The
  engine's ``fused_calls`` counter goes up once per micro-batch.
* Otherwise (unsupported architecture, plain PEFT on the CPU) the HF backbone runs.

Either way the LM head runs through :func:`chunked_logps_entropy` on the K shifted rows only:
at most ``chunk_rows`` x vocab logits exist at a time (``chunk_bytes`` of fp32, 256 MiB by default:
523 rows at vocab 128256), each chunk recomputed in backward; never the full [tokens, vocab].
"""
from __future__ import annotations

import contextlib

import torch

#: fp32 logits bytes one chunk may hold (its log-softmax and the backward's copies come on top).
CHUNK_BYTES = 256 << 20


def chunked_logps_entropy(hidden, weight, bias, targets, temperature: float = 1.0,
                          softcap: float | None = None, logit_scale: float = 1.0,
                          chunk_rows: int | None = 1024, entropy: bool = True,
                          chunk_bytes: int = CHUNK_BYTES):
    """Per-token log p(target) and entropy from hidden states ``[N, d]``, ``chunk_rows`` rows at
    a time (capped so a chunk's fp32 logits fit ``chunk_bytes``); each chunk's logits are
    recomputed in backward (``torch.utils.checkpoint``), so at most ``[chunk_rows, vocab]`` logits
    exist at once. Returns (logps [N] fp32, entropy [N] fp32 or None).
    """
    from torch.utils.checkpoint import checkpoint

    def piece(h, w, b, y):
        z = torch.nn.functional.linear(h, w, b)
        z = (z.float() if z.dtype in (torch.float16, torch.bfloat16) else z) * logit_scale
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        logp_all = torch.log_softmax(z, dim=-1)
        lp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else lp.new_zeros(())
        return lp, ent

    cap = max(1, chunk_bytes // max(1, weight.shape[0] * 4))
    rows = min(chunk_rows or cap, cap)
    lps, ents = [], []
    for s in range(0, hidden.shape[0], rows):
        args = (hidden[s:s + rows], weight, bias, targets[s:s + rows])
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(piece, *args, use_reentrant=False)
        else:
            lp, ent = piece(*args)
        lps.append(lp)
        ents.append(ent)
    logps = torch.cat(lps) if lps else hidden.new_zeros(0)
    return logps, (torch.cat(ents) if entropy and ents else None)


def policy_logps(model, input_ids, attention_mask, logits_to_keep: int, temperature: float = 1.0,
                 batch_size: int | None = None, entropy: bool = False, autocast=None):
    """(logps [B, K] fp32, entropies [B, K] or None) of the last K tokens (see module docstring).

    ``model`` is the PeftModel or the HF model it wraps; ``batch_size`` rows run at a time;
    ``autocast`` an optional context-manager factory around the backbone (the trainer's).
    """
    from worker.engine.engine import engine_state, hidden_states

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    fused = engine_state(lm) is not None
    head = lm.get_output_embeddings()
    cfg = lm.config.get_text_config()
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    K = logits_to_keep
    batch_size = batch_size or input_ids.size(0)
    all_lp, all_ent = [], []
    for s in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[s:s + batch_size], attention_mask[s:s + batch_size]
        with (autocast or contextlib.nullcontext)():
            if fused:
                h = hidden_states(lm, ids, mask)
            else:
                h = lm.base_model(input_ids=ids, attention_mask=mask,
                                  use_cache=False).last_hidden_state
        h = h[:, -K - 1:-1]
        y = ids[:, -K:]
        m = mask[:, -K:].bool()
        lp, ent = chunked_logps_entropy(h.reshape(-1, h.shape[-1]), head.weight, head.bias,
                                        y.reshape(-1), temperature, softcap, scale,
                                        chunk_rows=None, entropy=entropy)
        all_lp.append(lp.view_as(y).masked_fill(~m, 0.0))
        if entropy:
            all_ent.append(ent.view_as(y).masked_fill(~m, 0.0))
    return torch.cat(all_lp), (torch.cat(all_ent) if entropy else None)
