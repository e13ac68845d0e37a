"""The reference decode (worker.export.verify.hf_greedy) on the real stories260K + a LoRA adapter:
KV-cached steps give the tokens and top-k logits of a full re-forward per token, run on one
intra-op thread for a small model (the default of one per core made it 20-70x slower on a loaded
2-core box), and report every step so the export's progress moves."""
from __future__ import annotations

import time

import pytest

from tests.export.conftest import need_data  # noqa: F401
from worker.export import verify as V


@pytest.fixture(scope="module")
def info(run_dir):
    from worker.export.run import load_run

    return load_run(run_dir)


@pytest.fixture(scope="module")
def trained(info):
    import torch

    from worker.export.run import load_trained_model

    return load_trained_model(info, dtype=torch.float32)


def full_reforward(model, ids, n):
    """The old decode: the whole sequence forwarded again for every new token."""
    import torch

    seq, tops, threads = list(ids), [], torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            v, i = torch.topk(logits, V.TOP_K)
            tops.append([[int(a), float(b)] for a, b in zip(i, v)])
            seq.append(int(torch.argmax(logits)))
    torch.set_num_threads(threads)
    return seq[len(ids):], tops


def test_cached_greedy_matches_a_full_reforward_and_reports_each_step(trained):
    import torch

    ids = [1, 403, 407, 261, 378, 429, 269, 270, 306, 1]  # BOS + a few stories260K tokens
    want, want_tops = full_reforward(trained, ids, V.MAX_NEW)
    steps, tops = [], []
    before = torch.get_num_threads()
    t = time.perf_counter()
    got = V.hf_greedy(trained, ids, end_ids=[], tops=tops, on_step=steps.append)
    took = time.perf_counter() - t
    assert got == want and len(got) == V.MAX_NEW
    assert [[i for i, _ in row] for row in tops] == [[i for i, _ in row] for row in want_tops]
    assert max(abs(a[1] - b[1]) for r, w in zip(tops, want_tops) for a, b in zip(r, w)) < 1e-4
    assert steps == list(range(1, V.MAX_NEW + 1))
    assert torch.get_num_threads() == before  # restored
    assert took < 10, took  # 32 steps of a 260K model: ~0.1 s idle; was 20-70 s under load


def test_greedy_stops_at_an_end_id(trained):
    ids = [1, 403, 407, 261]
    first = V.hf_greedy(trained, ids, end_ids=[])
    assert V.hf_greedy(trained, ids, end_ids=[first[2]])[:3] == first[:3]
    assert len(V.hf_greedy(trained, ids, end_ids=[first[2]])) <= 3


def test_small_models_decode_on_one_thread_large_ones_on_idle_cores(monkeypatch):
    import os

    assert V.cpu_threads(260_000) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.setattr(os, "getloadavg", lambda: (3.2, 0.0, 0.0))
    assert V.cpu_threads(7_000_000_000) == 13
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 0.0, 0.0))
    assert V.cpu_threads(7_000_000_000) == 1


def test_reference_progress_moves_from_0_to_1(info, trained):
    from worker.export.run import load_tokenizer

    tok = load_tokenizer(info)
    seen = []
    refs = V.reference(trained, tok, ["Once upon a time", "The little dog"], [], False,
                       seen.append)
    assert len(refs) == 2 and all(len(r["continuation"]) == V.MAX_NEW for r in refs)
    assert seen == sorted(seen) and seen[-1] == 1.0
    assert len(set(seen)) == 2 * V.MAX_NEW and abs(seen[V.MAX_NEW - 1] - 0.5) < 1e-9
