"""Engine features beyond one gradient: adapters in PEFT's layout, fallbacks, RNG-exact recompute,
the VRAM budget planner, and a short training loop that tracks plain PEFT step for step."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model

from tests.engine.conftest import ALL7, lora_grads, randomise_lora, spec, tiny_model
from worker.engine import checkpointing as ckpt
from worker.engine import engine, optim
from worker.engine.quant import NF4Linear


def _batch(seed=0, B=2, S=17):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (B, S), generator=g)
    return ids, ids.clone()


def test_adapter_saves_and_loads_in_peft(tmp_path):
    base = tiny_model("qwen3")
    fresh = copy.deepcopy(base)
    pm = engine.prepare(base, spec(), load_in_4bit=True, impl="reference", device="cpu")
    randomise_lora(pm)
    assert isinstance(pm.get_base_model().model.layers[0].mlp.down_proj.base_layer, NF4Linear)
    pm.save_pretrained(tmp_path / "a")
    names = set(__import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(tmp_path / "a" / "adapter_model.safetensors")))
    assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "a")
    mine = {n: p for n, p in pm.named_parameters() if "lora_" in n}
    for n, p in loaded.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, mine[n]), n


def test_generation_path_uses_original_forward():
    base = tiny_model("llama")
    ref = get_peft_model(copy.deepcopy(base), engine.lora_config(spec()))
    pm = engine.prepare(base, spec(), impl="reference", device="cpu")
    randomise_lora(ref)
    randomise_lora(pm)
    ids, _ = _batch()
    with torch.no_grad():
        a = ref(input_ids=ids).logits
        b = pm(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-6)
    out = pm.generate(input_ids=ids[:1, :5], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 8)


def test_dropout_falls_back_and_recompute_replays_rng():
    runs = []
    for checkpointing in (False, True):
        pm = engine.prepare(tiny_model("llama"), spec(lora_dropout=0.3), impl="reference",
                            device="cpu", checkpointing=checkpointing)
        randomise_lora(pm)
        pm.train()
        ids, labels = _batch()
        torch.manual_seed(11)
        loss = pm(input_ids=ids, labels=labels).loss
        loss.backward()
        runs.append((loss.item(), lora_grads(pm)))
    (l0, g0), (l1, g1) = runs
    assert abs(l0 - l1) < 1e-6
    assert max((g0[k] - g1[k]).abs().max().item() for k in g0) < 1e-6


def test_unsupported_architecture_trains_with_peft_modules():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Phi3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = tf.Phi3ForCausalLM(cfg)
    lines = []
    pm = engine.prepare(model, spec(target_modules=["qkv_proj", "o_proj"]), impl="reference",
                        device="cpu", on_log=lines.append)
    assert any("phi3" in s and "plain modules" in s for s in lines), lines
    ids, labels = _batch()
    pm(input_ids=ids, labels=labels).loss.backward()
    assert all(p.grad is not None for n, p in pm.named_parameters() if "lora_A" in n)


def test_budget_planner():
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=32)
    per = ckpt.layer_activation_bytes(cfg, 4096)
    assert 300 << 20 < per < 800 << 20
    gib = 1 << 30
    assert ckpt.plan_layers(32, per, None, 6 * gib, gib) == 0
    assert ckpt.plan_layers(32, per, 8 * gib, 6 * gib, gib) == int(gib // per)
    assert ckpt.plan_layers(32, per, 80 * gib, 6 * gib, gib) == 32
    assert ckpt.plan_layers(32, per, 4 * gib, 6 * gib, gib) == 0


@pytest.mark.parametrize("nf4", [False, True])
def test_training_loop_tracks_peft(nf4):
    """4 AdamW steps with clipping: the engine's losses equal plain PEFT's (same init, same data)."""
    from tests.engine.conftest import nf4_roundtrip_

    base = tiny_model("gemma2")
    ref_base = copy.deepcopy(base)
    if nf4:
        nf4_roundtrip_(ref_base)
    ref = get_peft_model(ref_base, engine.lora_config(spec()))
    pm = engine.prepare(base, spec(), load_in_4bit=nf4, impl="reference", device="cpu")
    curves = []
    for m in (ref, pm):
        randomise_lora(m)
        m.train()
        opt = optim.make_optimizer(m, "adamw_torch", lr=1e-2)
        losses = []
        for _ in range(4):
            ids, labels = _batch(seed=0)  # one batch: the loss must fall
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            optim.clip_grad_norm(m, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves.append(losses)
    assert curves[1][-1] < curves[1][0]
    assert max(abs(a - b) for a, b in zip(*curves)) < 1e-4, curves


def test_optimizer_names():
    pm = engine.prepare(tiny_model("llama"), spec(target_modules=ALL7[:1]), impl="reference",
                        device="cpu")
    assert isinstance(optim.make_optimizer(pm, "adamw_torch"), torch.optim.AdamW)
    with pytest.raises(ValueError):
        optim.make_optimizer(pm, "sgd")
