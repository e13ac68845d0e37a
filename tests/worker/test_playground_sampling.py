"""The playground's top_k, min_p and repetition_penalty are applied by the worker's samplers, on
the real stories260K on the CPU: the engine path (worker.engine.chat.Stream over HF) and the
llama.cpp path of a GGUF export."""
from __future__ import annotations

import pytest

from worker.engine import chat

PROMPT = [{"role": "user", "content": "Once upon a time, there was a little"}]
N = 40


@pytest.fixture(scope="module")
def hf(stories_hf):
    return chat.load_hf(str(stories_hf), None, cuda=False)


@pytest.fixture(scope="module")
def gguf(stories_hf, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.export.gguf_writer import write_gguf

    path = tmp_path_factory.mktemp("pg_gguf") / "s.gguf"
    model = AutoModelForCausalLM.from_pretrained(stories_hf)
    write_gguf(model.state_dict(), model.config, AutoTokenizer.from_pretrained(stories_hf),
               path, "F32", tokenizer_dir=stories_hf)
    return chat.load_gguf(str(path), cuda=False, n_ctx=256)


def answer(loaded, **params):
    """``(token ids (HF only), text)`` of one whole answer to :data:`PROMPT`."""
    ids = chat.prompt_ids(loaded, chat.render_prompt(loaded, PROMPT, None))
    s = chat.Stream(loaded, "gguf" if loaded.kind == "gguf" else "fine_tuned", ids,
                    chat.Params(max_tokens=N, **params))
    while not s.done:
        s.step()
    return (s.generated if loaded.kind == "hf" else None), s.text


def test_engine_top_k_1_and_min_p_near_1_sample_the_argmax(hf):
    greedy, text = answer(hf, temperature=0)
    assert len(greedy) == N and text
    for seed in (1, 2):
        assert answer(hf, temperature=1.0, top_k=1, seed=seed)[0] == greedy
        assert answer(hf, temperature=1.0, min_p=0.999, seed=seed)[0] == greedy
    # off means off: the same draws without them leave the argmax path
    free = [answer(hf, temperature=1.5, seed=seed)[0] for seed in (1, 2)]
    assert all(f != greedy for f in free)
    # top_k=2 keeps two candidates: some draw takes a second-best token
    assert any(answer(hf, temperature=2.0, top_k=2, seed=seed)[0] != greedy
               for seed in (1, 2, 3))


def test_engine_repetition_penalty_matches_hf_generate(hf):
    import torch

    greedy, _ = answer(hf, temperature=0)
    assert len(set(greedy)) < len(greedy)  # the greedy story repeats tokens
    penalized, _ = answer(hf, temperature=0, repetition_penalty=1.5)
    assert penalized != greedy
    ids = chat.prompt_ids(hf, chat.render_prompt(hf, PROMPT, None))
    with torch.inference_mode():
        ref = hf.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N,
                                repetition_penalty=1.5, top_k=None, top_p=None,
                                temperature=None)[0, len(ids):].tolist()
    eos = hf.tokenizer.eos_token_id
    assert penalized == [t for t in ref if t != eos][:len(penalized)]
    assert len(set(penalized)) > len(set(greedy))  # more distinct tokens


def test_gguf_passes_them_to_llama_cpp(gguf):
    _, greedy = answer(gguf, temperature=0)
    assert len(greedy.split()) > 10
    for seed in (1, 2):
        assert answer(gguf, temperature=1.0, top_k=1, seed=seed)[1] == greedy
        assert answer(gguf, temperature=1.0, min_p=0.999, seed=seed)[1] == greedy
    # top_k 0 and min_p 0 are off in llama.cpp too: the draws leave the argmax path
    assert all(answer(gguf, temperature=1.5, seed=seed)[1] != greedy for seed in (1, 2))
    penalized = answer(gguf, temperature=0, repetition_penalty=1.5)[1]
    assert penalized and penalized != greedy
