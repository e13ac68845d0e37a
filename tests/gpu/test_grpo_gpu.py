"""GRPO on CUDA (runs only where CUDA exists; skipped in CI): TRL's fused Triton LM head gives
the same per-token log-probs as our chunked PyTorch path, and the toy task learns in bf16 with
its rollouts sampled by the engine's decoder.

Shared data comes from ``WHETSTONE_SHARED_DATA`` (default ``../shared/data``).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

SHARED = Path(os.environ.get("WHETSTONE_SHARED_DATA",
                             Path(__file__).resolve().parents[3] / "shared" / "data"))
STORIES = SHARED / "models" / "stories260K"


@pytest.fixture(scope="module")
def stories_hf(tmp_path_factory):
    if not (STORIES / "stories260K.bin").exists():
        pytest.skip(f"no stories260K under {SHARED}")
    from worker.engine.llama2c import convert

    out = tmp_path_factory.mktemp("stories")
    convert(STORIES / "stories260K.bin", STORIES / "tok512.bin", out)
    return out


def _trainer(stories_hf, tmp_path, **kw):
    from datasets import Dataset

    from app.store.specs import GrpoSpec
    from worker.engine import grpo, sft
    from worker.rewards.registry import build

    spec = GrpoSpec(model="m", dataset="d", **{
        "num_generations": 8, "per_device_train_batch_size": 16, "max_completion_length": 16,
        "learning_rate": 2e-3, "beta": 0.04, "r": 8, "lora_alpha": 16, "max_steps": 30,
        "seed": 1, "rewards": [{"name": "regex_match", "params": {"pattern": r"\bLily\b"}}],
        **kw})
    model = sft.add_lora(sft.load_model(str(stories_hf), False, True), spec)
    tok = sft.load_tokenizer(str(stories_hf), None)
    scorer = grpo.Scorer(build(spec, None), spec.num_generations, spec.scale_rewards)
    prompts = ["<s>Once upon a time", "<s>One day", "<s>There was a", "<s>Once there was"] * 30
    cb_holder = {}
    rewards = []
    cb = grpo.progress_callback(lambda **d: rewards.append(d.get("reward")), lambda **d: None,
                                lambda: None, lambda: cb_holder["t"])
    lines = []
    t = grpo.make_trainer(model, tok, Dataset.from_dict({"prompt": prompts}),
                          grpo.grpo_config(spec, str(tmp_path), True, "adamw_torch",
                                           save_strategy="no"), scorer, 32, [cb],
                          on_log=lines.append)
    cb_holder["t"] = t
    t.lines = lines
    return t, model, rewards


def test_engine_logps_match_full_logits(stories_hf, tmp_path):
    """The trainer's log-probs (engine layers + chunked head) against full logits from the
    model's plain forward (no labels: HF's own path), softmax at the sampling temperature."""
    t, model, _ = _trainer(stories_hf, tmp_path)
    ids = torch.tensor([[1, 403, 407, 261, 378, 30, 31, 40, 41]], device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours, oent, _ = t._get_per_token_logps_and_entropies(model, ids, mask, 5,
                                                             compute_entropy=True)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -6:-1].float()
        logp = torch.log_softmax(logits / t.temperature, dim=-1)
        want = logp.gather(-1, ids[:, -5:, None]).squeeze(-1)
        went = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(ours.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(oent.float(), went, rtol=2e-2, atol=2e-2)


def test_toy_task_learns_on_cuda(stories_hf, tmp_path):
    import time

    t, model, rewards = _trainer(stories_hf, tmp_path)
    assert t.ref_model is None
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    t.train()
    print(f"30 GRPO steps in {time.perf_counter() - t0:.1f}s, peak "
          f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, rewards {rewards}")
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25, rewards
    # rollouts came from the engine's decoder (static KV cache, CUDA-graph decode step)
    assert "generation: engine decoding (static KV cache, fused layers)" in t.lines, t.lines
