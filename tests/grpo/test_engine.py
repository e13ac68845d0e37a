"""Engine pieces: chunked log-probs equal full-softmax log-probs (values and gradients); the
reference policy is the adapter-disabled base (no second model); advantages are ours."""
from __future__ import annotations

import pytest
import torch

from worker.engine.grpo import Scorer, chunked_logps_entropy
from worker.rewards.base import RewardFunction


def test_chunked_logps_match_full_softmax():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=g)
    lp, ent = chunked_logps_entropy(h, w, None, y, temperature=0.7, chunk_rows=8)
    full = torch.log_softmax((h @ w.T) / 0.7, -1)
    ref_lp = full.gather(-1, y[:, None]).squeeze(-1)
    ref_ent = -(full.exp() * full).sum(-1)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    gh, gw = torch.autograd.grad((lp * torch.arange(37.0, dtype=torch.float64)).sum(), (h, w))
    rh, rw = torch.autograd.grad((ref_lp * torch.arange(37.0, dtype=torch.float64)).sum(), (h, w))
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)


class _Const(RewardFunction):
    def __init__(self, values):
        self.name, self.values = "const", values

    def score(self, batch):
        return self.values


def test_scorer_advantages_zero_for_equal_groups():
    s = Scorer([_Const(None)], 4, "group")
    fn = s.trl_functions()[0]
    s.functions[0].values = [1, 0, 0, 0, 2, 2, 2, 2]
    fn(prompts=["p"] * 8, completions=["c"] * 8, completion_ids=[[1]] * 8, col__answer=["a"] * 8)
    total, adv, zero = s.advantages()
    assert adv[:4] == pytest.approx([1.5, -0.5, -0.5, -0.5]) and adv[4:] == [0.0] * 4
    assert zero == 1 and fn.__name__ == "const"


def test_reference_is_the_adapter_disabled_base(stories_hf, tmp_path):
    from datasets import Dataset

    from app.store.specs import GrpoSpec
    from worker.engine import grpo, sft

    spec = GrpoSpec(model="m", dataset="d", beta=0.1, r=4, num_generations=2,
                    per_device_train_batch_size=2, max_steps=1, max_completion_length=4,
                    rewards=[{"name": "regex_match", "params": {"pattern": "a"}}])
    model = sft.add_lora(sft.load_model(str(stories_hf), False, False), spec)
    tok = sft.load_tokenizer(str(stories_hf), None)
    from worker.rewards.registry import build

    scorer = Scorer(build(spec, None), 2, "group")
    trainer = grpo.make_trainer(model, tok, Dataset.from_dict({"prompt": ["<s>One day"] * 4}),
                                grpo.grpo_config(spec, str(tmp_path), False, "adamw_torch"),
                                scorer, 8)
    assert trainer.ref_model is None  # TRL uses the PEFT model with its adapter disabled
    n_params = sum(p.numel() for p in trainer.model.parameters())
    assert n_params == sum(p.numel() for p in model.parameters())
    # with the adapter disabled the policy log-probs are the base model's
    ids = torch.tensor([[1, 403, 407, 261, 378, 30, 31]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for p in (p for n, p in model.named_parameters() if "lora_B" in n):
            p.add_(0.05)
        lora_lp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 3)
        with model.disable_adapter():
            ref_lp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, 3)
            logits = model(input_ids=ids).logits[:, -4:-1] / spec.temperature
        base_lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -3:, None]).squeeze(-1)
    torch.testing.assert_close(ref_lp, base_lp, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lora_lp, ref_lp)


def test_build_prompts_gsm8k_and_messages(stories_hf, tmp_path):
    from app.data.chat_template import DEFAULT_TEMPLATES
    from app.data.encode import load_tokenizer_bundle
    from worker.engine.grpo import COL, build_prompts

    bundle = load_tokenizer_bundle(stories_hf)
    gsm = tmp_path / "g.jsonl"
    gsm.write_text('{"question": "Tom has 3 apples.", "answer": "... #### 3"}\n'
                   '{"question": "", "answer": "#### 1"}\n')
    ps = build_prompts(str(gsm), bundle, DEFAULT_TEMPLATES["chatml"], None, None, "Think.")
    assert ps.rows == 1 and ps.skipped == 1 and ps.answer_column == "answer"
    assert ps.dataset[0]["prompt"] == ("<|im_start|>system\nThink.<|im_end|>\n<|im_start|>user\n"
                                       "Tom has 3 apples.<|im_end|>\n<|im_start|>assistant\n")
    assert ps.dataset[0][COL + "answer"] == "... #### 3"
    rft = tmp_path / "m.jsonl"
    rft.write_text('{"messages": [{"role": "user", "content": "Yo"}, {"role": "assistant", '
                   '"content": "x"}], "ref": "7"}\n'
                   '{"messages": [{"role": "user", "content": "Hi"}], "ref": "8"}\n')
    ps = build_prompts(str(rft), bundle, None, None, "ref", None)
    # a row ending on an assistant turn: its prompt is the conversation up to the user turn
    assert ps.rows == 2 and ps.skipped == 0 and ps.row_numbers == [1, 2]
    assert [r["prompt"] for r in ps.dataset] == ["<s>Yo", "<s>Hi"]
    assert ps.prompt_column == "messages"


def test_trainer_runs_policy_reference_and_generation_through_the_engine(stories_hf, tmp_path):
    """One GRPO step of the trainer on an engine-prepared NF4 stories260K (CPU, reference impl):
    every log-prob pass runs the fused layers, generation runs through the engine's decoder with the
    NF4 weights held dense (no PEFT LoRA module forward anywhere), and the dense copies are gone
    after the step."""
    from datasets import Dataset
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from app.store.specs import GrpoSpec
    from worker.engine import engine, grpo, sft
    from worker.engine.gencache import nf4_modules
    from worker.rewards.registry import build

    spec = GrpoSpec(model="m", dataset="d", beta=0.1, r=4, num_generations=2,
                    per_device_train_batch_size=2, max_steps=1, max_completion_length=5,
                    rewards=[{"name": "regex_match", "params": {"pattern": "a"}}])
    base = AutoModelForCausalLM.from_pretrained(str(stories_hf), dtype=torch.float32)
    model = engine.prepare(base, spec, load_in_4bit=True, impl="reference", device="cpu",
                           vram_budget_gib=4.0)
    st = engine.engine_state(model)
    tok = sft.load_tokenizer(str(stories_hf), None)
    unfused, lines = [0], []
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.register_forward_hook(lambda *a: unfused.__setitem__(0, unfused[0] + 1))
    mods = nf4_modules(model)
    scorer = Scorer(build(spec, None), 2, "group")
    trainer = grpo.make_trainer(model, tok, Dataset.from_dict({"prompt": ["<s>One day"] * 4}),
                                grpo.grpo_config(spec, str(tmp_path), False, "adamw_torch",
                                                 save_strategy="no"),
                                scorer, 8, on_log=lines.append)
    trainer.train()
    assert st.fused_calls >= 2  # the policy loss pass and the beta > 0 reference pass
    assert len(lines) == 2 and f"{len(mods)}/{len(mods)} NF4 weights held dense" in lines[0]
    assert lines[1] == "generation: engine decoding (static KV cache, fused layers)"
    assert all(m._dense is None for m in mods)
    assert unfused[0] == 0  # PEFT's own LoRA modules never ran: generation is the engine's too
    assert all(p.grad is None or torch.isfinite(p.grad).all()
               for n, p in model.named_parameters() if "lora_" in n)
