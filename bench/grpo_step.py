"""GRPO step benchmark of the Whetstone engine, protocol of ../shared/BENCHMARKS.md (GRPO anchor).

Same protocol as ../shared/bench/grpo_anchor.py: Llama-3.1-8B architecture with random bf16 weights,
QLoRA r=16 alpha=16 dropout 0 on q,k,v,o,gate,up,down, ``num_generations`` completions of
``completion_len`` tokens from one ``prompt_len``-token prompt a step (per-device batch =
num_generations, no accumulation), beta 0.04, lr 5e-6, temperature 1, HF ``generate`` with the KV
cache (no vLLM), the anchor's reward (completion characters / 100), a step timed by a
``TrainerCallback`` from ``on_step_begin`` to ``on_step_end`` with ``torch.cuda.synchronize()``;
median of the steps after the first; peak = ``torch.cuda.max_memory_allocated()`` /
``max_memory_reserved()`` reset after loading, before ``train()``.

The step runs through our GRPO path exactly as the ``grpo`` job builds it: the kernel engine
(``worker.engine.engine.prepare``: PEFT layout, NF4 bases, fused forward), our ``GrpoSpec``, the
:class:`worker.engine.grpo.Scorer` (validated rewards, zero-variance-safe advantages),
:func:`worker.engine.grpo.grpo_config` and :func:`worker.engine.grpo.make_trainer`.

    python3 bench/grpo_step.py                                   # 256 + 256, 8 generations, 4 steps
    python3 bench/grpo_step.py --prompt-len 1024 --completion-len 1024 --steps 2
    python3 bench/grpo_step.py --model-dir /tmp/rand-llama8b     # load the anchor's saved model
    python3 bench/grpo_step.py --tiny --steps 3                  # CPU smoke run (2 small layers)

The model is made in memory on the GPU (as bench/train_step.py does) unless ``--model-dir`` names a
saved one (``../shared/bench/anchors.py make``), which then loads the way the job loads a model.
``BENCH_LAYERS`` overrides the 32 layers. Prints ``STEP i seconds`` per step, ``GEN i seconds`` for
each rollout (generation phase, GPU-synchronised) and ``RESULT {json}``,
and appends the row to $OUT/grpo.jsonl: bench="grpo", impl="whetstone", config, prompt_len,
completion_len, num_generations, steps, step_s, peak_alloc_gib, peak_reserved_gib, device, date,
commit (``WHETSTONE_COMMIT`` or git), call_id (``CALL_ID``), plus the step times and run details.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_k] = "1"

from train_step import ARCH, TARGETS, _commit  # noqa: E402  (one definition of the 8B model)

TINY = dict(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def tokenizer():
    """The anchor's word-level tokenizer (``t0``..``t3999`` + specials), made in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(4000)}
    vocab.update({"<|begin_of_text|>": 4000, "<|end_of_text|>": 4001, "<|pad|>": 4002})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>", pad_token="<|pad|>")


def build(args, cuda: bool, spec):
    """(PEFT model through the engine, tokenizer): random weights, QLoRA (LoRA with --lora)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.engine import engine, sft

    torch.manual_seed(0)
    if args.model_dir:
        model = sft.load_model(args.model_dir, spec.load_in_4bit, cuda)
        tok = sft.load_tokenizer(args.model_dir, None)
    else:
        arch = {**ARCH, **(TINY if args.tiny else {})}
        if args.tiny and os.environ.get("BENCH_LAYERS"):
            arch["num_hidden_layers"] = int(os.environ["BENCH_LAYERS"])
        cfg = LlamaConfig(**arch)
        torch.set_default_dtype(torch.bfloat16 if cuda else torch.float32)
        with torch.device("cuda" if cuda else "cpu"):
            model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        tok = tokenizer()
    pm = engine.prepare(model, spec, load_in_4bit=spec.load_in_4bit, impl=engine.default_impl(),
                        device="cuda" if cuda else "cpu", vram_budget_gib=spec.vram_budget_gib,
                        on_log=lambda s: print(s, flush=True))
    if cuda:
        torch.cuda.empty_cache()
    return pm, tok


def run(args) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from app.store.specs import GrpoSpec
    from worker.engine import grpo
    from worker.rewards.base import PerSample

    cuda = torch.cuda.is_available()
    qlora = not args.lora
    if qlora and not cuda and not args.tiny:
        raise SystemExit("QLoRA needs CUDA (use --tiny for the CPU smoke run)")
    plen, clen, gens = args.prompt_len, args.completion_len, args.num_generations
    spec = GrpoSpec(
        model="bench", dataset="bench", chat_template="none",
        rewards=[{"name": "length_penalty", "params": {"target_tokens": clen}}],  # replaced below
        num_generations=gens, max_prompt_length=plen, max_completion_length=clen,
        temperature=1.0, top_p=1.0, beta=0.04, learning_rate=5e-6,
        per_device_train_batch_size=gens * args.prompts_per_step, gradient_accumulation_steps=1,
        max_steps=args.steps,
        r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
        load_in_4bit=qlora, seed=3407, logging_steps=1, vram_budget_gib=args.budget)
    transformers.set_seed(spec.seed)

    t_load = time.time()
    pm, tok = build(args, cuda, spec)
    t_load = time.time() - t_load

    # The anchor's reward: characters of the completion / 100 (varies with the sampled tokens, so
    # the advantages are not all zero), through our validated PerSample reward.
    reward = PerSample("length_chars", lambda s: len(s.completion) / 100.0)
    scorer = grpo.Scorer([reward], spec.num_generations, spec.scale_rewards)
    out_dir = tempfile.mkdtemp(prefix="grpo-bench-")
    overrides = dict(save_strategy="no", reward_weights=[1.0])
    if not cuda:
        overrides.update(bf16=False, fp16=False)
    cfg = grpo.grpo_config(spec, out_dir, cuda, spec.optim, **overrides)
    words = " ".join(f"t{i % 4000}" for i in range(plen))
    ds = Dataset.from_list([{"prompt": words} for _ in range(64)])

    times: list[float] = []
    logged: list[dict] = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync()
            times.append(time.perf_counter() - self.t)
            print(f"STEP {len(times)} {times[-1]:.3f}s", flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    trainer = grpo.make_trainer(pm, tok, ds, cfg, scorer, plen, [Timer()],
                                on_log=lambda m: print(m, flush=True))
    gen_times: list[float] = []  # seconds in the rollout (generation) phase, per step
    inner_generate = trainer._generate

    def timed_generate(prompts):
        sync()
        t0 = time.perf_counter()
        try:
            return inner_generate(prompts)
        finally:
            sync()
            gen_times.append(time.perf_counter() - t0)
            print(f"GEN {len(gen_times)} {gen_times[-1]:.3f}s", flush=True)

    trainer._generate = timed_generate
    assert trainer.ref_model is None  # reference = the adapter-disabled base, no second copy
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    mem_after_load = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    trainer.train()
    scorer.close()
    rest = sorted(times[1:]) or times
    med = rest[len(rest) // 2]
    lens = [lg.get("completions/mean_length") for lg in logged]
    base = pm.get_base_model()
    n_layers = base.config.num_hidden_layers
    res = dict(
        bench="grpo", impl="whetstone", config="qlora" if qlora else "lora",
        cfg=f"whetstone_{'qlora' if qlora else 'lora'}", prompt_len=plen, completion_len=clen,
        num_generations=gens, steps=args.steps, step_s=round(med, 2),
        completions_per_step=spec.per_device_train_batch_size,
        peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        mem_after_load_gib=round(mem_after_load, 2), load_s=round(t_load, 1),
        step_times=[round(t, 3) for t in times], generate_times=[round(t, 3) for t in gen_times],
        completion_mean_length=[round(x, 1) if x is not None else None for x in lens],
        reward=[round(s["reward"], 4) for s in trainer.stats] if trainer.stats else None,
        kl=[lg.get("kl") for lg in logged], loss=[lg.get("loss") for lg in logged],
        layers=n_layers, tiny=bool(args.tiny), beta=spec.beta, optim=spec.optim,
        engine_patched=getattr(base, "_whetstone", None) is not None,
        device=torch.cuda.get_device_name() if cuda else "cpu",
        date=datetime.date.today().isoformat(), commit=_commit(),
        call_id=os.environ.get("CALL_ID", ""), torch=torch.__version__, trl=trl.__version__,
        transformers=transformers.__version__)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=256)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=1,
                    help="prompts (groups of num_generations) per step; 2 matches the 16 "
                         "completions a step Unsloth's trainer runs in the anchor")
    ap.add_argument("--model-dir", default=None, help="load a saved model (anchors.py make)")
    ap.add_argument("--budget", type=float, default=None, help="VRAM budget in GiB (engine)")
    ap.add_argument("--lora", action="store_true", help="bf16 LoRA instead of QLoRA")
    ap.add_argument("--tiny", action="store_true",
                    help="2 layers of hidden 128, vocab 8192: CPU smoke run of the same path")
    a = ap.parse_args(argv)
    res = run(a)
    print("RESULT", json.dumps(res), flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "grpo.jsonl"), "a") as fh:
        fh.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
