"""Engine (reference path, fp32, CPU) vs plain transformers + PEFT: loss and every LoRA gradient.

Grid: Llama (llama3 RoPE), Qwen3 (q/k norm), Gemma-2 (GeGLU, (1+w) norms, sandwich norms, soft-caps,
sliding windows, tied embeddings); dense and NF4 bases (reference = PEFT on the dequantised
weights); checkpointing on/off; padded batches and padding-free packing (reference = each sequence
on its own, summed with the same token normaliser).
"""
from __future__ import annotations

import copy

import pytest
import torch
from peft import get_peft_model

from tests.engine.conftest import lora_grads, nf4_roundtrip_, randomise_lora, spec, tiny_model
from worker.engine import engine

TOL = 1e-5


def _pair(arch, nf4=False, checkpointing=True, **lora_kw):
    base = tiny_model(arch)
    ref_base = copy.deepcopy(base)
    s = spec(**lora_kw)
    if nf4:
        nf4_roundtrip_(ref_base)
    ref = get_peft_model(ref_base, engine.lora_config(s))
    eng = engine.prepare(base, s, load_in_4bit=nf4, impl="reference", device="cpu",
                         checkpointing=checkpointing)
    randomise_lora(ref)
    randomise_lora(eng)
    ref.train()
    eng.train()
    return ref, eng


def _batch(seed=0, B=2, S=21, V=96, pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    labels = ids.clone()
    labels[:, :3] = -100  # a "prompt"
    if pad:
        mask[1, S - 6:] = 0
        labels[1, S - 6:] = -100
    return ids, mask, labels


def _compare(ref, eng, fwd):
    lr = fwd(ref)
    lr.backward()
    le = fwd(eng)
    le.backward()
    assert abs(lr.item() - le.item()) <= TOL, (lr.item(), le.item())
    gr, ge = lora_grads(ref), lora_grads(eng)
    assert gr.keys() == ge.keys() and len(gr) > 0
    worst = max((gr[k] - ge[k]).abs().max().item() for k in gr)
    assert worst <= TOL, worst
    assert max(g.abs().max().item() for g in gr.values()) > 1e-3  # gradients are not trivially 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("nf4", [False, True])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_padded_batch(arch, nf4, checkpointing):
    ref, eng = _pair(arch, nf4, checkpointing)
    ids, mask, labels = _batch()
    _compare(ref, eng, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("nf4", [False, True])
def test_packed_padding_free(arch, nf4):
    ref, eng = _pair(arch, nf4, checkpointing=True)
    lens = [7, 12, 9]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in lens]
    labs = [s.clone() for s in seqs]
    for lab in labs:
        lab[:2] = -100
    n_items = torch.tensor(sum(int((lab[1:] != -100).sum()) for lab in labs))
    ids = torch.cat(seqs)[None]
    labels = torch.cat(labs)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]

    def fwd(m):
        if m is ref:  # each sequence alone, the same per-token normaliser
            return sum(m(input_ids=s[None], labels=lab[None], num_items_in_batch=n_items).loss
                       for s, lab in zip(seqs, labs))
        return m(input_ids=ids, position_ids=pos, labels=labels, num_items_in_batch=n_items).loss

    _compare(ref, eng, fwd)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
def test_more_architectures(arch):
    ref, eng = _pair(arch, nf4=False, checkpointing=True)
    ids, mask, labels = _batch(seed=5)
    _compare(ref, eng, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels,
                                   num_items_in_batch=torch.tensor(20)).loss)


def test_rslora_and_partial_targets():
    ref, eng = _pair("llama", use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])
    ids, mask, labels = _batch(seed=7)
    _compare(ref, eng, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss)
