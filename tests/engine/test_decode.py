"""Engine decoding (worker.engine.decode) against HF ``generate`` on the same model, CPU, fp32.

Greedy decoding through the engine's static KV cache and layers gives HF's tokens exactly (tiny
random Llama, Qwen3, Qwen2 and stories260K; NF4 and dense bases; LoRA with non-zero B; left-padded
prompts of different lengths); EOS handling pads like HF; the sampling processors mask the same
logits as HF's warpers; unsupported options fall back to HF with the reason logged.
"""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tests.engine.conftest import randomise_lora, spec, stories_nf4, tiny_model
from worker.engine import decode, engine
from worker.engine.decode_proj import CHECKED, decode_proj, fused_ok

NEW = 10


def _prepared(arch, nf4):
    pm = engine.prepare(tiny_model(arch), spec(), load_in_4bit=nf4, impl="reference", device="cpu")
    randomise_lora(pm)
    return pm.eval()


def _prompts(seed=3, V=96):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (3, 7), generator=g)
    lead = torch.tensor([[0], [3], [1]])
    mask = (torch.arange(7)[None] >= lead).long()
    return ids.masked_fill(mask == 0, 0), mask


def _cfg(**kw):
    d = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=[95])
    d.update(kw)
    return GenerationConfig(**d)


def _hf(pm, ids, mask, cfg):
    with torch.no_grad():
        return pm.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)


@pytest.mark.parametrize("arch,nf4", [("llama", True), ("llama", False), ("qwen3", True),
                                      ("qwen2", False)])
def test_greedy_equals_hf(arch, nf4):
    pm = _prepared(arch, nf4)
    ids, mask = _prompts()
    cfg = _cfg(eos_token_id=[])
    ref = _hf(pm, ids, mask, cfg)
    ours = decode.generate(pm, ids, mask, cfg)
    assert ours.shape == ref.shape == (3, 7 + NEW)
    assert torch.equal(ours, ref), (ours, ref)


def test_stories260k_greedy_equals_hf(stories_hf):
    pm, ids, mask = stories_nf4(stories_hf)
    cfg = _cfg(max_new_tokens=24, eos_token_id=[])
    assert torch.equal(decode.generate(pm, ids, mask, cfg), _hf(pm, ids, mask, cfg))


def test_eos_rows_pad_like_hf():
    pm = _prepared("llama", True)
    ids, mask = _prompts()
    free = decode.generate(pm, ids, mask, _cfg(eos_token_id=[]))
    eos = int(free[1, 7 + 2])  # row 1's third generated token ends it
    cfg = _cfg(eos_token_id=[eos])
    ref, ours = _hf(pm, ids, mask, cfg), decode.generate(pm, ids, mask, cfg)
    n = ref.shape[1]
    assert torch.equal(ours[:, :n], ref)
    assert (ours[:, n:] == 0).all()  # at most SYNC_EVERY trailing pad columns after HF's stop
    assert (ours[1, 7 + 3:] == 0).all() and ours[1, 7 + 2] == eos


@pytest.mark.parametrize("opt", [dict(min_new_tokens=6), dict(min_length=7 + 5)])
def test_min_new_tokens_and_min_length_hold_eos_back_like_hf(opt):
    pm = _prepared("llama", True)
    ids, mask = _prompts()
    free = decode.generate(pm, ids, mask, _cfg(eos_token_id=[]))
    eos = int(free[1, 7 + 2])  # row 1 would end at its third token without the minimum
    cfg = _cfg(eos_token_id=[eos], **opt)
    assert decode.unsupported(pm, cfg) is None
    ref, ours = _hf(pm, ids, mask, cfg), decode.generate(pm, ids, mask, cfg)
    n = ref.shape[1]
    assert torch.equal(ours[:, :n], ref), (ours, ref)
    assert (ours[1, 7:7 + 5] != eos).all()  # EOS held back for the first five tokens at least


def test_processors_match_hf_warpers():
    from transformers.generation.logits_process import (
        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
        TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    ids = torch.randint(0, 50, (4, 9), generator=g)
    cfg = _cfg(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, min_p=0.05,
               repetition_penalty=1.3)
    ref = logits.clone()
    for proc in (RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7),
                 TopKLogitsWarper(20), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        ref = proc(ids, ref)
    ours = decode.warp(logits, ids, cfg)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    fin = ~torch.isinf(ref)
    torch.testing.assert_close(ours[fin], ref[fin])
    assert fin.sum(-1).min() >= 1
    # sampling only ever picks kept tokens
    toks = torch.stack([decode.sample(logits, ids, cfg) for _ in range(200)], 1)
    assert fin.gather(1, toks).all()


def test_top_k_one_is_greedy_and_defaults_resolved():
    pm = _prepared("llama", True)
    ids, mask = _prompts()
    greedy = decode.generate(pm, ids, mask, _cfg(eos_token_id=[]))
    torch.manual_seed(0)
    one = decode.generate(pm, ids, mask, _cfg(do_sample=True, top_k=1, eos_token_id=[]))
    assert torch.equal(one, greedy)
    # HF fills top_k=50 when the caller (TRL) leaves it None: ours must resolve the same way
    assert decode.resolve_config(pm, _cfg(do_sample=True, top_k=None)).top_k == 50


def test_fast_generate_routes_and_falls_back():
    pm = _prepared("llama", True)
    ids, mask = _prompts()
    said = []
    cfg = _cfg(eos_token_id=[])
    ref = _hf(pm, ids, mask, cfg)
    with decode.fast_generate(pm, on_log=said.append):
        out = _hf(pm, ids, mask, cfg)  # PeftModel.generate -> the engine's decoder
    assert torch.equal(out, ref)
    assert said == ["generation: engine decoding (static KV cache, fused layers)"]
    said.clear()
    with decode.fast_generate(pm, on_log=said.append):
        _hf(pm, ids, mask, _cfg(num_beams=2))
    assert said and "num_beams" in said[0] and said[0].startswith("generation: HF generate")
    assert "generate" not in vars(pm.get_base_model())  # restored


def test_generation_options_as_keywords_like_hf():
    """generate(ids, max_new_tokens=..., min_new_tokens=...) as HF takes them; a keyword that is
    not a generation option (a streamer, a model input) sends the call to HF, named."""
    pm = _prepared("llama", True)
    ids, mask = _prompts()
    kw = dict(max_new_tokens=NEW, min_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=[5])
    with torch.no_grad():
        ref = pm.generate(input_ids=ids, attention_mask=mask, **kw)
    said = []
    with decode.fast_generate(pm, on_log=said.append), torch.no_grad():
        out = pm.generate(input_ids=ids, attention_mask=mask, **kw)
    assert said == ["generation: engine decoding (static KV cache, fused layers)"]
    assert torch.equal(out[:, :ref.shape[1]], ref)
    why = decode.unsupported(pm, None, dict(max_new_tokens=4, streamer=object()))
    assert why == "generate() arguments ['streamer']"


def test_unsupported_architecture_reason():
    pm = _prepared("gemma2", False)
    assert "gemma2" in decode.unsupported(pm, _cfg())


def test_dense_generation_cache_is_used_once_per_phase():
    from worker.engine.gencache import dense_generation, nf4_modules

    pm = _prepared("llama", True)
    ids, mask = _prompts()
    cfg = _cfg(eos_token_id=[])
    plain = decode.generate(pm, ids, mask, cfg)
    mods = nf4_modules(pm)
    n0 = sum(m.dequants for m in mods)
    with dense_generation(pm, limit=1 << 40):
        cached = decode.generate(pm, ids, mask, cfg)
    assert sum(m.dequants for m in mods) - n0 == len(mods)  # once each for the whole phase
    assert torch.equal(cached, plain)


def test_fused_nf4_matmul_is_checked_before_use():
    """The decode path checks the NF4 matmul against dequantise + GEMM once per weight shape and
    dequantises shapes it refuses (K=96 is not a multiple of the blocksize) or gets wrong."""
    from functools import partial

    from whetstone_kernels.nf4_matmul import nf4_matmul

    pm = _prepared("llama", True)
    layer = pm.base_model.model.model.layers[0]
    q, down = (decode_proj(m, "reference", False) for m in (layer.self_attn.q_proj,
                                                             layer.mlp.down_proj))
    for lin in (q, down):
        lin.state = lin.base.state()
    good = partial(nf4_matmul, impl="reference")
    CHECKED.clear()
    n0 = q.base.dequants
    assert fused_ok(good, q, torch.float32)  # [64, 64]
    assert fused_ok(good, q, torch.float32)  # cached: no second dequantisation
    assert q.base.dequants == n0 + 1
    assert not fused_ok(good, down, torch.float32)  # [64, 96]: refused
    CHECKED.clear()

    def wrong(x, packed, state):
        return 1.01 * good(x, packed, state)

    assert not fused_ok(wrong, q, torch.float32)
    CHECKED.clear()
    # right but slower than dequantise + GEMM on this device: not used
    clock = iter([1.0, 0.5])
    assert not fused_ok(good, q, torch.float32, timer=lambda fn: (fn(), next(clock))[1])
    CHECKED.clear()
    clock = iter([0.5, 1.0])
    assert fused_ok(good, q, torch.float32, timer=lambda fn: (fn(), next(clock))[1])
    CHECKED.clear()


def test_fused_projection_adds_bias_and_lora_in_the_kernel():
    """DecodeProj on the fused NF4 kernel (Triton; the interpreter on CPU) hands it the bias and the
    LoRA term and gets what dequantise + GEMM + addmm gives, with x A^T computed here or passed in
    as a column slice of the shared q/k/v product."""
    from whetstone_kernels.nf4_matmul import nf4_matmul
    from worker.engine.quant import dense_weight

    pm = _prepared("llama", True)
    attn = pm.base_model.model.model.layers[0].self_attn
    q, k = (decode_proj(m, "triton", False, torch.float32) for m in (attn.q_proj, attn.k_proj))
    q.bias = torch.randn(q.base.out_features)
    x = torch.randn(3, q.base.in_features)
    with torch.no_grad():
        want = q(x, None)  # no kernel: dequantise + GEMM, bias, addmm
        q.state = q.base.state()
        got = q(x, nf4_matmul)
        shared = x @ torch.cat([k.A, q.A]).t()
        got_shared = q(x, nf4_matmul, shared[:, k.A.shape[0]:])
        no_lora = x @ dense_weight(q.base, torch.float32).t() + q.bias
    assert q.state is not None  # the kernel ran (no fallback)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_shared, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, no_lora, atol=1e-3)  # the LoRA term (randomised B) is in it


def test_lora_xa_by_the_skinny_kernel_and_its_fallback(caplog):
    """x A^T of a projection by whetstone_kernels.skinny_matmul (interpreter on CPU) equals the GEMM,
    inside DecodeProj too; 64 rows and more take the GEMM; a kernel that raises is logged once and
    the GEMM answers from then on."""
    from whetstone_kernels.skinny_matmul import skinny_matmul
    from worker.engine import decode_proj as dp

    pm = _prepared("llama", True)
    q = decode_proj(pm.base_model.model.model.layers[0].self_attn.q_proj, "triton", False, torch.float32)
    x = torch.randn(5, q.base.in_features)
    calls = []

    def counted(a, b):
        calls.append(a.shape[0])
        return skinny_matmul(a, b)

    with torch.no_grad():
        want = q(x, None)
        q.skinny = counted
        got = q(x, None)
        torch.testing.assert_close(dp.lora_xa(x, q.A, counted), x @ q.A.t(), rtol=1e-5, atol=1e-5)
        dp.lora_xa(torch.randn(dp.SMALL_M, q.base.in_features), q.A, counted)  # too many rows: GEMM

        def broken(a, b):
            raise RuntimeError("no such kernel")
        try:
            with caplog.at_level("WARNING", logger="worker.engine.decode"):
                first = dp.lora_xa(x, q.A, broken)
                dp.lora_xa(x, q.A, counted)  # disabled after the failure: GEMM
        finally:
            dp._SKINNY_FAILED.clear()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [5, 5]
    torch.testing.assert_close(first, x @ q.A.t())
    assert [r.getMessage() for r in caplog.records] == [
        "decode: skinny_matmul failed (no such kernel); x A^T by GEMM from now on"]


def test_sliding_window_and_lora_dropout_fall_back_to_hf():
    pm = _prepared("mistral", True)  # tiny Mistral: sliding_window 8
    ids, mask = _prompts()
    long_cfg = _cfg(eos_token_id=[])
    assert "sliding window 8 < 17 tokens" in decode.unsupported(pm, long_cfg, {}, 7)
    said = []
    with decode.fast_generate(pm, on_log=said.append):
        out = _hf(pm, ids, mask, long_cfg)
    assert said[0].startswith("generation: HF generate (sliding window")
    assert torch.equal(out, _hf(pm, ids, mask, long_cfg))
    short = _cfg(max_new_tokens=1, eos_token_id=[])  # 7 + 1 <= 8: the engine decodes it
    assert decode.unsupported(pm, short, {}, 7) is None
    assert torch.equal(decode.generate(pm, ids, mask, short), _hf(pm, ids, mask, short))

    drop = engine.prepare(tiny_model("llama"), spec(lora_dropout=0.1), impl="reference",
                          device="cpu")
    assert "lora_dropout > 0" in decode.unsupported(drop, _cfg(), {}, 7)


def test_one_token_prompt_equals_hf():
    pm = _prepared("llama", True)
    ids, mask = torch.tensor([[5], [9]]), torch.ones(2, 1, dtype=torch.long)
    cfg = _cfg(eos_token_id=[])
    assert torch.equal(decode.generate(pm, ids, mask, cfg), _hf(pm, ids, mask, cfg))


class _Stop(BaseException):
    pass


@pytest.mark.parametrize("engine_path", [True, False])
def test_check_abandons_a_long_generation(engine_path):
    """A stop request (JobContext.check raising) ends generation within SYNC_EVERY tokens on the
    engine's path and after one token on HF's, instead of running max_new_tokens."""
    pm = _prepared("llama", True)
    ids, mask = _prompts()
    calls = []

    def check():
        calls.append(1)
        if len(calls) >= 2:
            raise _Stop()

    extra = {} if engine_path else {"no_repeat_ngram_size": 3}  # an option only HF implements
    cfg = _cfg(max_new_tokens=100, eos_token_id=[], **extra)
    said = []
    with decode.fast_generate(pm, on_log=said.append, check=check), pytest.raises(_Stop):
        _hf(pm, ids, mask, cfg)
    assert said[0].startswith("generation: engine" if engine_path else "generation: HF")
    assert len(calls) == 2


def test_unpatched_model_is_routed_to_hf_and_says_so():
    from peft import get_peft_model

    from worker.engine.engine import lora_config

    pm = get_peft_model(tiny_model("llama"), lora_config(spec())).eval()
    ids, mask = _prompts()
    said = []
    with decode.fast_generate(pm, on_log=said.append):
        out = _hf(pm, ids, mask, _cfg(eos_token_id=[]))
    assert out.shape == (3, 7 + NEW)
    assert said == ["generation: HF generate (the engine is not patched on this model)"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_attention_kernel_gives_hfs_tokens(arch, monkeypatch):
    """The decode step's attention through whetstone_kernels.decode_attention (what CUDA runs; here
    under the Triton interpreter, fp32): greedy tokens equal HF's, left padding included."""
    from whetstone_kernels.decode_attention import decode_attention

    calls = []

    def kernel(*a, **kw):
        calls.append(a[3].shape)
        return decode_attention(*a, **kw)

    init = decode._Model.__init__

    def with_kernel(self, model):
        init(self, model)
        self.attn = kernel

    monkeypatch.setattr(decode._Model, "__init__", with_kernel)
    pm = _prepared(arch, True)
    ids, mask = _prompts()
    cfg = _cfg(eos_token_id=[])
    ours = decode.generate(pm, ids, mask, cfg)
    assert len(calls) == (NEW - 1) * pm.config.num_hidden_layers  # every decode step, every layer
    assert torch.equal(ours, _hf(pm, ids, mask, cfg))
