"""The SFT engine's loss is the mean token loss over the whole effective batch.

With gradient accumulation over micro-batches of very different label counts, the accumulated
gradient must equal the gradient of (sum of all token losses) / (all label tokens), not the
mean of per-micro-batch means.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from app.store.specs import TrainSpec  # noqa: E402
from worker.engine import sft  # noqa: E402


def _labels(ids: list[int], n_prompt: int) -> list[int]:
    return [-100] * n_prompt + ids[n_prompt:]


def test_loss_normalised_per_token_across_gradient_accumulation(stories_hf: Path,
                                                                 tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback

    torch.manual_seed(0)
    spec = TrainSpec(model="m", dataset="d", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                     per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1,
                     max_grad_norm=0.0, warmup_ratio=0.0, learning_rate=1e-3, max_seq_length=128)
    model = sft.add_lora(sft.load_model(str(stories_hf), False, False), spec)
    for n, p in model.named_parameters():  # non-zero B so that A gets gradients too
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    reference = copy.deepcopy(model)
    tok = sft.load_tokenizer(str(stories_hf), None)
    short = tok("Lily.")["input_ids"]
    long = tok("Once upon a time there was a big dog who liked to run in the park.")["input_ids"]
    examples = [{"input_ids": short, "labels": _labels(short, 1)},
                {"input_ids": long, "labels": _labels(long, 3)}]
    ds = Dataset.from_list(examples)

    captured: dict[str, torch.Tensor] = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            for n, p in model.named_parameters():
                if p.requires_grad:
                    captured[n] = p.grad.detach().clone()

    args = sft.sft_config(spec, str(tmp_path / "out"), cuda=False, optim="adamw_torch",
                          save_strategy="no", logging_steps=1)
    trainer = sft.make_trainer(model, tok, ds, args, [Grab()])
    trainer.train()
    assert captured

    # reference: token-mean over both sequences together
    counts, sums = [], []
    for ex in examples:
        ids = torch.tensor([ex["input_ids"]])
        labels = torch.tensor([ex["labels"]])
        n = int((labels[:, 1:] != -100).sum())
        counts.append(n)
        sums.append(reference(input_ids=ids, labels=labels).loss * n)
    (sum(sums) / sum(counts)).backward()
    params = dict(reference.named_parameters())
    for n, g in captured.items():
        ref = params[n.replace("module.", "")].grad
        assert torch.allclose(g, ref, atol=1e-7, rtol=1e-4), n
    assert any(g.abs().sum() > 0 for g in captured.values())
    assert counts[0] != counts[1]

    # the naive mean of micro-batch means would give a different gradient
    naive = copy.deepcopy(reference)
    naive.zero_grad()
    for ex in examples:
        out = naive(input_ids=torch.tensor([ex["input_ids"]]), labels=torch.tensor([ex["labels"]]))
        (out.loss / 2).backward()
    nparams = dict(naive.named_parameters())
    assert any(not torch.allclose(g, nparams[n.replace("module.", "")].grad, rtol=1e-3)
               for n, g in captured.items())


def _one_step_grads(stories_hf: Path, out: Path, examples: list[dict], **spec_kw):
    from datasets import Dataset
    from transformers import TrainerCallback

    torch.manual_seed(0)
    spec = TrainSpec(model="m", dataset="d", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                     per_device_train_batch_size=2, max_steps=1, max_grad_norm=0.0,
                     warmup_ratio=0.0, learning_rate=1e-3, max_seq_length=128, **spec_kw)
    model = sft.add_lora(sft.load_model(str(stories_hf), False, False), spec)
    for n, p in model.named_parameters():  # non-zero B so that A gets gradients too
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    captured: dict[str, torch.Tensor] = {}
    batches: list[dict] = []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            captured.update({n: p.grad.detach().clone() for n, p in model.named_parameters()
                             if p.requires_grad})

    args = sft.sft_config(spec, str(out), cuda=False, optim="adamw_torch", save_strategy="no",
                          logging_steps=1)
    tok = sft.load_tokenizer(str(stories_hf), None)
    trainer = sft.make_trainer(model, tok, Dataset.from_list(examples), args, [Grab()])
    collate = trainer.data_collator
    trainer.data_collator = lambda rows: batches.append(collate(rows)) or batches[-1]
    trainer.train()
    return captured, batches[0]


def test_padding_free_batches_train_like_padded_ones(stories_hf: Path, tmp_path: Path) -> None:
    """``padding_free``: the two rows of a micro-batch go into one sequence with no pad token
    (position_ids restart, each row's first label masked), and the LoRA gradient is the padded
    batch's: attention stays inside each row."""
    tok = sft.load_tokenizer(str(stories_hf), None)
    short = tok("Lily.")["input_ids"]
    long = tok("Once upon a time there was a big dog who liked to run in the park.")["input_ids"]
    examples = [{"input_ids": short, "labels": _labels(short, 1)},
                {"input_ids": long, "labels": _labels(long, 3)}]
    padded, pb = _one_step_grads(stories_hf, tmp_path / "a", examples, padding_free=False)
    free, fb = _one_step_grads(stories_hf, tmp_path / "b", examples, padding_free=True)
    assert tuple(pb["input_ids"].shape) == (2, len(long)) and "attention_mask" in pb
    assert tuple(fb["input_ids"].shape) == (1, len(short) + len(long))
    assert "attention_mask" not in fb
    pos = fb["position_ids"][0].tolist()  # the rows in the trainer's (shuffled) order
    starts = [i for i, p in enumerate(pos) if p == 0]
    assert len(starts) == 2 and pos == list(range(starts[1])) + list(range(len(pos) - starts[1]))
    assert sorted([starts[1], len(pos) - starts[1]]) == sorted([len(short), len(long)])
    assert (fb["labels"][0, starts] == -100).all()
    assert padded.keys() == free.keys() and any(g.abs().sum() > 0 for g in free.values())
    for n, g in padded.items():
        assert torch.allclose(free[n], g, atol=1e-7, rtol=1e-4), n


def test_eight_bit_optimizer_falls_back_on_cpu() -> None:
    optim, warn = sft.resolve_optim("paged_adamw_8bit", cuda=False)
    assert optim == "adamw_torch" and "paged_adamw_8bit" in warn
    assert sft.resolve_optim("adamw_torch", cuda=False) == ("adamw_torch", None)


def test_qlora_on_cpu_is_a_clear_error(stories_hf: Path) -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        sft.load_model(str(stories_hf), True, False)
