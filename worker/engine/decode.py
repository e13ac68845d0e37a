"""Fast sampling with a static KV cache through the engine's own layers (GRPO rollouts).

HF ``generate`` on a PEFT model runs ~15 Python-level modules per projection for every token; on an
H200 with Llama-3.1-8B QLoRA and 8 rows that is 143 ms of wall time per token for 22 ms of GPU work
(bench/profile_step.py, 2026-11-29). :func:`generate` is a drop-in for ``model.generate`` of a
patched Llama-like model (Llama, Mistral, Qwen2/2.5, Qwen3) that runs the decoder directly:

* **Prefill** of the left-padded prompt ids [B, P] in one pass per layer: RMSNorm, q/k/v, [q/k
  norm], RoPE (whetstone_kernels.rope) at HF's positions (``cumsum(attention_mask) - 1``), SDPA with a causal
  mask that hides pad keys; k and v (after RoPE) are written to a cache [B, Hk, P + T, D] per layer.
* **Decode** of one token per row per step: the same layer with the query attending to the cache,
  pad keys masked: on CUDA with the Triton kernels, ``whetstone_kernels.decode_attention`` (one pass
  over the P + t columns written so far, the column read on the device, so one graph serves every
  token; fp32 online softmax); otherwise ``q [B, Hk, G, D] @ k^T`` in the compute dtype over all
  P + T columns, unwritten ones masked, fp32 softmax, times V. Projections (:mod:`worker.engine.decode_proj`) with fewer than 64 rows and
  an NF4 base run through ``whetstone_kernels.nf4_matmul`` (NF4 dequantised in registers, never stored
  dense) when it is available on CUDA and is right and faster than dequantise + GEMM on that
  weight shape and GPU (``fused_ok``, decided once per shape); otherwise the base weight is dequantised (or read dense,
  cached by gencache) and multiplied. LoRA: ``y += s (x A^T) B^T`` with the active adapter (A, B
  cast to the compute dtype once per call; x A^T of q, k, v, and of gate, up, as one product each,
  a ``skinny_matmul`` launch on CUDA; the B term in the NF4 matmul's epilogue when it runs).
* **CUDA graph**: the decode step (embedding, every layer, the logits) is captured once per call
  and replayed for each later token (:class:`_Stepper`), so a token costs its GPU time, not ~1,600
  Python-level kernel launches; ``WHETSTONE_DECODE_GRAPHS=0`` runs it eagerly.
* **Sampling** (:mod:`worker.engine.sampling`) follows HF's processors in HF's order: EOS held
  back until ``min_length`` / ``min_new_tokens``, repetition penalty, temperature, top-k, top-p,
  min-p, then ``torch.multinomial`` (``do_sample``) or argmax. A row that emits an EOS id emits
  ``pad_token_id`` afterwards; the loop stops once every row has finished (checked every
  :data:`SYNC_EVERY` steps, so a few trailing pad columns may follow; callers cut at the first EOS).

Returns ids [B, P + n] int64 like HF (prompt then generated tokens). :func:`unsupported` says why a
model/config cannot take this path (the caller then uses HF's ``generate``): another architecture,
a sliding window shorter than P + T, beams, a LoRA variant, or generation options beyond the above.
"""
from __future__ import annotations

import contextlib
import logging
import os
import types

import torch
import torch.nn.functional as F

from worker.engine.decode_proj import (decode_proj, fused_ok, lora_xa, nf4_matmul_kernel, shared_lora_a,
                                      split_lora_a)
from worker.engine.sampling import NEUTRAL, _eos_ids, resolve_config, sample, warp  # noqa: F401

log = logging.getLogger("worker.engine.decode")

#: The decoder's projections and their modules in a Llama-like decoder layer.
PROJ_PATHS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
#: Steps between the host checks of "every row finished".
SYNC_EVERY = 8


def unsupported(model, generation_config=None, kwargs=None, prompt_len: int | None = None
                ) -> str | None:
    """Why :func:`generate` cannot serve this call (None when it can); ``prompt_len`` (P, the
    padded prompt width) lets it check a sliding window against P + max_new_tokens."""
    from worker.engine.engine import engine_state
    from worker.engine.lora_ops import lora_params
    from worker.engine.patch import LLAMA_LIKE

    st = engine_state(model)
    if st is None:
        return "the engine is not patched on this model"
    if st.arch.model_type not in LLAMA_LIKE:
        return f"fast decoding covers {', '.join(LLAMA_LIKE)}, not {st.arch.model_type}"
    kwargs = {k: v for k, v in (kwargs or {}).items() if k not in ("input_ids", "attention_mask")}
    try:
        gc = resolve_config(model, generation_config, **kwargs)
    except Exception as e:  # noqa: BLE001 (HF refuses the config: let HF's generate say why)
        return str(e) if str(e).startswith("generate() arguments") else f"generation config: {e}"
    other = sorted(k for k, neutral in NEUTRAL.items()
                   if getattr(gc, k, neutral) not in (neutral, None, False, 0))
    if other:
        return f"generation options {other}"
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_A"):
            try:
                lora_params(mod)
            except ValueError as e:  # dropout > 0 (HF samples with it in train mode), DoRA, ...
                return f"LoRA on {name}: {e}"
    window = _window(model, st)
    if window is not None and prompt_len is not None:
        total = prompt_len + (gc.max_new_tokens if gc.max_new_tokens is not None
                              else gc.max_length - prompt_len)
        if window < total:
            return f"sliding window {window} < {total} tokens"
    return None


def _window(model, st):
    """The sliding window of a model whose layers use one, else None."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    if st.arch.windows.get("sliding_attention") and "sliding_attention" in st.arch.layer_types:
        return getattr(hf.config, "sliding_window", None)
    return None


class _Model:
    """The decoder of a patched model, resolved once per generate call."""

    def __init__(self, model):
        from worker.engine.engine import engine_state
        from whetstone_kernels.decode_attention import decode_attention

        st = engine_state(model)
        self.st, self.hf = st, model.get_base_model() if hasattr(model, "get_base_model") else model
        inner = self.hf.model
        self.inner, self.impl = inner, st.impl
        dev = inner.embed_tokens.weight.device
        on_cuda = dev.type == "cuda"
        self.fused = nf4_matmul_kernel() if (st.impl == "triton" and on_cuda) else None
        self.attn = decode_attention if (st.impl == "triton" and on_cuda) else None
        self.layers = []
        dtype = inner.embed_tokens.weight.dtype
        for layer in inner.layers:
            projs = {n: decode_proj(layer.get_submodule(path), st.impl, on_cuda, dtype)
                     for n, path in PROJ_PATHS.items()}
            L = types.SimpleNamespace(mod=layer, attn=layer.self_attn, **projs)
            L.qkv_A = shared_lora_a([L.q, L.k, L.v])  # x A^T of q, k, v (and of gate, up): one GEMM
            L.gu_A = shared_lora_a([L.gate, L.up])
            self.layers.append(L)
        for L in self.layers if self.fused is not None else ():
            for name in PROJ_PATHS:
                lin = getattr(L, name)
                if lin.state is not None and not fused_ok(self.fused, lin, dtype):
                    lin.state = None

    def norm(self, mod, x):
        from worker.engine.patch import norm

        return norm(mod, x, False, self.impl)

    def layer(self, L, h, cos, sin, kc, vc, col, keymask):
        """One decoder layer over h [B, S, H]; returns h.

        Prefill (``col`` the int 0, any S): k/v go to cache columns [0, S); keymask [B, 1, S, S]
        bool (True = attend: causal, pad keys hidden). Decode (S == 1, ``col`` a 1-element int64
        tensor, so a CUDA graph can replay it): k/v go to column ``col``; the query attends to
        every cache column where keymask [B, P + T] (the valid-key map) is True."""
        from whetstone_kernels.rope import rope

        from worker.engine.lora_ops import _glu

        a = L.attn
        B, S, _ = h.shape
        D = a.head_dim
        x = self.norm(L.mod.input_layernorm, h)
        xa = split_lora_a(self._xa(x, L.qkv_A, L.q), (L.q, L.k, L.v))
        q = L.q(x, self.fused, xa[0]).view(B, S, -1, D)
        k = L.k(x, self.fused, xa[1]).view(B, S, -1, D)
        v = L.v(x, self.fused, xa[2]).view(B, S, -1, D).transpose(1, 2)
        if self.st.arch.qk_norm:
            q, k = self.norm(a.q_norm, q), self.norm(a.k_norm, k)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, impl=self.impl)
        Hq, Hk = q.shape[1], k.shape[1]
        if not torch.is_tensor(col):  # prefill (any width, 1 included): SDPA, padded causal mask
            kc[:, :, :S], vc[:, :, :S] = k, v
            rep = Hq // Hk
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1),
                                               attn_mask=keymask, scale=a.scaling)
            o = o.transpose(1, 2).reshape(B, S, Hq * D)
        elif self.attn is not None:  # one query per row: one pass over the columns written so far
            kc.index_copy_(2, col, k)
            vc.index_copy_(2, col, v)
            o = self.attn(q[:, :, 0], kc, vc, keymask, col, a.scaling).reshape(B, 1, Hq * D)
        else:  # one query per row: grouped heads against the whole cache, unwritten keys masked
            kc.index_copy_(2, col, k)
            vc.index_copy_(2, col, v)
            qg = q.reshape(B, Hk, Hq // Hk, D)
            sc = (qg @ kc.transpose(-1, -2)).float() * a.scaling
            sc = sc.masked_fill(~keymask[:, None, None, :], float("-inf"))
            o = (torch.softmax(sc, -1).to(vc.dtype) @ vc).reshape(B, 1, Hq * D)
        h = h + L.o(o, self.fused)
        x = self.norm(L.mod.post_attention_layernorm, h)
        glu = _glu(self.impl)[0]
        xa = split_lora_a(self._xa(x, L.gu_A, L.gate), (L.gate, L.up))
        act = glu(L.gate(x, self.fused, xa[0]), L.up(x, self.fused, xa[1]), self.st.arch.activation)
        return h + L.down(act, self.fused)

    @staticmethod
    def _xa(x, A, proj):
        """x [..., in] @ A^T as [rows, sum r] (None when A is None), by ``proj``'s skinny kernel."""
        return None if A is None else lora_xa(x.reshape(-1, x.shape[-1]), A, proj.skinny)

    def logits(self, h_last):
        """fp32 logits [B, V] of the last position's hidden state h_last [B, H]."""
        h = self.norm(self.inner.norm, h_last)
        return (h @ self.hf.lm_head.weight.t().to(h.dtype)).float()


def graphs_enabled(device) -> bool:
    """CUDA graphs for the decode step: on CUDA unless WHETSTONE_DECODE_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get("WHETSTONE_DECODE_GRAPHS", "1") != "0"


class _Stepper:
    """One decode step (embed, all layers, logits) over static input buffers; on CUDA it is
    captured once as a CUDA graph (after a warm-up run, which also compiles the Triton kernels)
    and replayed for every later token. A step is idempotent (it rewrites the same cache column
    with the same values), so the warm-up and capture runs are harmless. If capture fails the
    steps run eagerly (the reason is logged)."""

    def __init__(self, M, kcs, vcs, valid, B, use_graph: bool):
        dev = valid.device
        self.M, self.kcs, self.vcs, self.valid = M, kcs, vcs, valid
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.use_graph, self.graph, self.out = use_graph, None, None

    def _run(self):
        M = self.M
        self.valid.index_fill_(1, self.col, True)
        h = M.inner.embed_tokens(self.tok)
        cos, sin = M.inner.rotary_emb(h, self.pos)
        for L, kc, vc in zip(M.layers, self.kcs, self.vcs):
            h = M.layer(L, h, cos, sin, kc, vc, self.col, self.valid)
        return M.logits(h[:, -1])

    def __call__(self, tok, pos, col: int):
        """fp32 logits [B, V] after feeding tok [B] at positions pos [B, 1], cache column col."""
        self.tok.copy_(tok[:, None])
        self.pos.copy_(pos)
        self.col.fill_(col)
        if self.graph is not None:
            self.graph.replay()
            return self.out
        if not self.use_graph:
            return self._run()
        self.use_graph = False
        side = _warmup_stream(self.tok.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self._run()
        torch.cuda.current_stream().wait_stream(side)
        try:
            g = torch.cuda.CUDAGraph()
            # thread_local: the worker's heartbeat thread may touch CUDA during the capture
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                self.out = self._run()
            self.graph = g
        except Exception as e:  # noqa: BLE001 (eager decoding is correct, only slower)
            log.warning("decode: CUDA graph capture failed (%s); decoding eagerly", e)
            return out
        g.replay()
        return self.out


_WARMUP_STREAMS: dict = {}


def _warmup_stream(dev) -> "torch.cuda.Stream":
    """The one side stream a process warms decode steps up on, per device. cuBLAS keeps a
    workspace (32 MiB on Hopper) for every stream it has run on, allocated through the caching
    allocator and never returned: a new stream per generation (torch hands out up to 32 pooled
    streams) grew a GRPO job's allocated memory by 32 MiB a step, to 1.07 GiB for a 0.22 GiB job
    after 40 steps (H200 call s17-c2; bench/memory_peak.py found the blocks, s17-c3)."""
    s = _WARMUP_STREAMS.get(dev)
    if s is None:
        s = _WARMUP_STREAMS[dev] = torch.cuda.Stream(dev)
    return s


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, generation_config=None, check=None,
             **kwargs):
    """Sample ``max_new_tokens`` per row of left-padded ``input_ids`` [B, P] (see module doc).

    ``check()`` (optional) is called every :data:`SYNC_EVERY` tokens; it raises to abandon the
    generation (a cancelled job). Raises ValueError when :func:`unsupported` gives a reason
    (callers check it first)."""
    why = unsupported(model, generation_config, kwargs, input_ids.shape[1])
    if why:
        raise ValueError(f"fast decoding: {why}")
    return _decode(model, input_ids, attention_mask, generation_config, check, **kwargs)


@torch.no_grad()
def _decode(model, input_ids, attention_mask, generation_config, check, **kwargs):
    """:func:`generate` after :func:`unsupported` has said yes (no second check); ``kwargs`` are
    generation options (``max_new_tokens=...``) over ``generation_config``, as in HF."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = resolve_config(model, generation_config, **kwargs)
    T = cfg.max_new_tokens if cfg.max_new_tokens is not None \
        else cfg.max_length - input_ids.shape[1]
    B, P = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    M = _Model(model)
    inner, dev = M.inner, input_ids.device
    eos = torch.tensor(_eos_ids(cfg) or [-1], device=dev)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (_eos_ids(cfg) or [0])[0]
    h = inner.embed_tokens(input_ids)
    heads = hf.config.num_key_value_heads
    D = M.layers[0].attn.head_dim
    kcs = [h.new_zeros(B, heads, P + T, D) for _ in M.layers]
    vcs = [h.new_zeros(B, heads, P + T, D) for _ in M.layers]
    valid = torch.zeros(B, P + T, dtype=torch.bool, device=dev)
    valid[:, :P] = attention_mask.bool()
    pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    i = torch.arange(P, device=dev)
    mask = (i[:, None] >= i[None, :])[None] & valid[:, None, :P]
    mask = (mask | torch.eye(P, dtype=torch.bool, device=dev)[None])[:, None]
    cos, sin = inner.rotary_emb(h, pos)
    for L, kc, vc in zip(M.layers, kcs, vcs):
        h = M.layer(L, h, cos, sin, kc, vc, 0, mask)
    ids = torch.empty(B, P + T, dtype=torch.long, device=dev)
    ids[:, :P] = input_ids
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    step = _Stepper(M, kcs, vcs, valid, B, use_graph=graphs_enabled(dev))
    nxt_pos = pos[:, -1:] + 1
    logits = M.logits(h[:, -1])
    n = 0
    for t in range(T):
        tok = sample(logits, ids[:, :P + t], cfg, new_len=t)
        tok = torch.where(done, torch.full_like(tok, pad), tok)
        ids[:, P + t] = tok
        done |= torch.isin(tok, eos)
        n = t + 1
        if (t + 1) % SYNC_EVERY == 0 and check is not None:
            check()
        if t == T - 1 or ((t + 1) % SYNC_EVERY == 0 and bool(done.all())):
            break
        logits = step(tok, nxt_pos, P + t)
        nxt_pos = nxt_pos + 1
    M.graph_used = step.graph is not None
    return ids[:, :P + n]


def _stop_criteria(check):
    """A transformers StoppingCriteria that calls ``check()`` after every token (it raises to
    abandon the generation) and never stops a row itself."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Check(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            check()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Check()])


@contextlib.contextmanager
def fast_generate(model, on_log=None, check=None):
    """Within the block ``model.generate`` (PEFT and HF) takes :func:`generate` whenever
    :func:`unsupported` allows, else HF's own (any model, patched or not); the first choice is
    told to ``on_log`` as a ``generation: ...`` line. ``check()`` is called while generating
    (every :data:`SYNC_EVERY` tokens on the engine's path, every token on HF's) and may raise to
    abandon the generation, so a cancel does not wait for a long rollout to end."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    orig = hf.generate
    told = [on_log] if on_log else []

    def gen(self, input_ids=None, attention_mask=None, generation_config=None, **kw):
        width = input_ids.shape[1] if input_ids is not None else None
        why = unsupported(model, generation_config, kw, width)
        if told:
            told.pop()("generation: " + (f"HF generate ({why})" if why else
                                         "engine decoding (static KV cache, fused layers)"))
        if why:
            if check is not None and "stopping_criteria" not in kw:
                kw["stopping_criteria"] = _stop_criteria(check)
            return orig(input_ids=input_ids, attention_mask=attention_mask,
                        generation_config=generation_config, **kw)
        return _decode(model, input_ids, attention_mask, generation_config, check, **kw)

    hf.generate = types.MethodType(gen, hf)
    try:
        yield
    finally:
        del hf.generate
