"""Playground decode benchmark: tokens/s of a playground session on one GPU (worker.engine.chat).

Llama-3.1-8B architecture (bench/train_step.py's ARCH; ``BENCH_LAYERS`` for a smoke run) with
random bf16 weights made on the GPU and a PEFT LoRA r=16 on every linear projection (B random,
so the adapter changes the answer), as a playground session holds a run's model. A prompt of
``--prompt`` random token ids; each answer is ``--tokens`` new tokens (EOS disabled, so every
answer runs to its length), sampled at temperature 0.7 / top_p 0.95 like the page's default.

Two measurements, as the session answers them (worker/jobs/playground.py):

* ``single``: one pane (``/v1/chat/completions`` on a fine-tuned id): first-token latency
  (prefill + one step) and decode tokens/s;
* ``both``: the page's two panes interleaved token by token (fine-tuned, then the base with the
  adapter switched off): tokens/s per pane and together.

Peak GPU memory (``torch.cuda.max_memory_allocated``) is printed; compare it with the studio's
estimate of such a session (:func:`app.studio.playground.estimate_gib`, 17.2 GiB: it reserves a
4096-token cache a pane; tests/studio/test_playground_admission.py checks the 8B figures).

    python3 bench/playground_decode.py [--prompt 512] [--tokens 256]

Prints ``RESULT {json}`` and appends it to $OUT/playground_decode.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_step import ARCH, TARGETS, _commit  # noqa: E402  (one definition of the 8B model)


class _Tokenizer:
    """What a Stream asks of a tokenizer: no EOS, a cheap decode (one character a token)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):  # noqa: ARG002
        return "x" * len(ids)


def build():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.engine.chat import Loaded

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**ARCH))
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS,
                                             task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.eval()
    return Loaded("hf", model, _Tokenizer(), {}, True, ARCH["max_position_embeddings"], "cuda")


def answer(loaded, sides: list[str], prompt: list[int], tokens: int) -> dict:
    """Run the sides' streams interleaved to the end; per side: first-token seconds, decode
    tokens/s (after the first token) and the tokens; ``wall`` seconds in all."""
    import torch

    from worker.engine.chat import Params, Stream

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    streams = [Stream(loaded, s, prompt, Params(0.7, 0.95, tokens, seed=1)) for s in sides]
    firsts: dict[str, float] = {}
    while any(not s.done for s in streams):
        for s in streams:
            s.step()
            if s.side not in firsts and s.generated:
                firsts[s.side] = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"wall_s": round(wall, 3)}
    for s in streams:
        n = len(s.generated)
        out[s.side] = {"tokens": n, "first_token_s": round(firsts[s.side], 4),
                       "decode_tokens_per_s": round((n - 1) / (wall - firsts[s.side]), 2)}
    out["tokens_per_s_all_panes"] = round(sum(len(s.generated) for s in streams) / wall, 2)
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    loaded = build()
    torch.cuda.reset_peak_memory_stats()
    prompt = torch.randint(0, ARCH["vocab_size"], (args.prompt,)).tolist()
    answer(loaded, ["fine_tuned"], prompt, 8)  # warm-up (kernels, allocator)
    single = answer(loaded, ["fine_tuned"], prompt, args.tokens)
    both = answer(loaded, ["fine_tuned", "base"], prompt, args.tokens)
    res = {"bench": "playground_decode", "model": "Llama-3.1-8B shape, random bf16, LoRA r=16",
           "prompt_tokens": args.prompt, "new_tokens": args.tokens, "single": single,
           "both": both, "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "date": datetime.datetime.utcnow().isoformat() + "Z",
           "commit": _commit()}
    print("RESULT " + json.dumps(res), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "playground_decode.jsonl"), "a") as fh:
            fh.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
