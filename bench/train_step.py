"""Training-step benchmark of the Whetstone engine, protocol of ../shared/BENCHMARKS.md.

Llama-3.1-8B architecture (``BENCH_LAYERS`` overrides the 32 layers for a smoke run) with random bf16
weights made on the GPU, LoRA r=16 alpha=16 dropout 0 on q,k,v,o,gate,up,down, fp32 LoRA weights,
torch AdamW (fused) on the LoRA parameters, checkpointing on (budgeted when ``--budget GIB``), random
token ids; a step is forward with labels + backward + optimizer step, synchronised; median of the
steps after 2 warm-ups; peak = ``torch.cuda.max_memory_allocated()`` (reset after loading).

    python3 bench/train_step.py qlora 2048 2 8 [--budget 40]    # one configuration, one process
    python3 bench/train_step.py lora 2048 2 8
    python3 bench/train_step.py qlora 2048 1 40 --rows 8   # padding-free, as the default job runs

``--rows N``: each step is one sequence of N rows of real-like lengths (bench/warmup_probe.py's
lognormal draw, median ~240, each at most SEQ; positions restart per row), as the worker's default
job packs a micro-batch; a fixed draw of 8 steps' lengths is cycled, so two trees see the same
steps. tokens_per_s is then the tokens of the steps after the first pass over those 8 (its
warm-up) over their summed time (steps differ in length), ``step_s`` their mean. bench/ab_call.sh alternates two trees' runs of this mode.

Prints ``RESULT {json}`` and appends the row to $OUT/train_step.jsonl with the fields of
../shared/bench/anchors.py plus bench="train_step", impl="whetstone", config, vram_budget_gib, device,
date, commit (``WHETSTONE_COMMIT`` or git), call_id (``CALL_ID``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARCH = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
if os.environ.get("BENCH_LAYERS"):
    ARCH["num_hidden_layers"] = int(os.environ["BENCH_LAYERS"])


def flops_per_token(seq: int) -> float:
    """Same formula as anchors.py: 4 N_linear + 3 causal attention (no recompute counted)."""
    h, f, L = ARCH["hidden_size"], ARCH["intermediate_size"], ARCH["num_hidden_layers"]
    kv = h * ARCH["num_key_value_heads"] // ARCH["num_attention_heads"]
    n = (h * h * 2 + h * kv * 2 + 3 * h * f) * L + h * ARCH["vocab_size"]
    return 4 * n + 3 * (2 * 2 * seq * h * L / 2)


def _commit() -> str:
    c = os.environ.get("WHETSTONE_COMMIT")
    if c:
        return c
    try:
        return subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def build(config: str, budget, offload: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.engine import engine

    torch.manual_seed(0)
    cfg = LlamaConfig(**ARCH)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    spec = SimpleNamespace(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                           use_rslora=False)
    pm = engine.prepare(model, spec, load_in_4bit=config == "qlora", impl="triton", device="cuda",
                        checkpointing=True, vram_budget_gib=budget, offload=offload,
                        on_log=lambda s: print(s, flush=True))
    torch.cuda.empty_cache()
    return pm


def _gc_timer() -> list:
    """[seconds spent in Python GC passes, number of passes] since the last reset, via gc.callbacks."""
    import gc

    acc, t = [0.0, 0], [0.0]

    def cb(phase, info):
        if phase == "start":
            t[0] = time.perf_counter()
        else:
            acc[0] += time.perf_counter() - t[0]
            acc[1] += 1
    gc.callbacks.append(cb)
    return acc


def run(config: str, seq: int, bs: int, steps: int, budget, offload: bool, rows: int = 0) -> dict:
    import torch

    t_load = time.time()
    pm = build(config, budget, offload)
    pm.train()
    t_load = time.time() - t_load
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, fused=True)
    if os.environ.get("BENCH_GC_FREEZE"):  # experiment: are slow outlier steps Python GC passes?
        import gc

        gc.collect()
        gc.freeze()
    gc_s = _gc_timer()
    g = torch.Generator(device="cuda").manual_seed(1)
    if rows:
        from bench.warmup_probe import lengths, positions

        plans = lengths(8, rows, seq)
        batches = [dict(input_ids=torch.randint(0, 4000, (1, sum(ls)), device="cuda", generator=g),
                        position_ids=positions(ls))
                   for ls in plans]
    else:
        batches = [dict(input_ids=torch.randint(0, 4000, (bs, seq), device="cuda", generator=g))
                   for _ in range(4)]
    mem_after_load = torch.cuda.memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    times, losses, gc_ms, issue = [], [], [], []
    for step in range(steps):
        gc_s[0], gc_s[1] = 0.0, 0
        kw = batches[step % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = pm(**kw, labels=kw["input_ids"])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        issue.append(time.perf_counter() - t0)  # the CPU's time to queue the step's work
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        gc_ms.append((round(gc_s[0] * 1e3, 1), gc_s[1]))
        losses.append(float(out.loss))
    # diagnostic after the timed steps: the CPU's issue time vs the GPU's time, forward and
    # backward apart (a phase whose issue time is about its GPU time is CPU-bound)
    kw = batches[0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = pm(**kw, labels=kw["input_ids"])
    phases = [time.perf_counter() - t0]
    torch.cuda.synchronize()
    phases.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out.loss.backward()
    phases.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    phases.append(time.perf_counter() - t0)
    opt.zero_grad(set_to_none=True)
    timed = sorted(times[2:])
    med = timed[len(timed) // 2]
    tps = bs * seq / med
    if rows:  # steps differ in length: tokens over time, after one pass over the 8 lengths
        warm = len(batches)     # (a new longest step pins new offload blocks: warm-up, not steady)
        if steps <= warm:
            raise SystemExit(f"--rows needs more than {warm} steps (the first {warm} warm up)")
        toks = [batches[i % warm]["input_ids"].numel() for i in range(warm, steps)]
        med = sum(times[warm:]) / len(times[warm:])
        tps = sum(toks) / sum(times[warm:])
    flops = flops_per_token(seq) * tps
    kept = pm.get_base_model()._whetstone.kept_layers
    return dict(
        cfg=f"whetstone_{config}", seq=seq, bs=bs, steps=steps, step_s=round(med, 4),
        rows=rows or None, step_tokens=[b["input_ids"].numel() for b in batches] if rows else None,
        tokens_per_s=round(tps, 1), tflops=round(flops / 1e12, 1),
        mfu_vs_790=round(flops / 790e12, 3),
        peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
        mem_after_load_gib=round(mem_after_load, 2), load_s=round(t_load, 1),
        loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4),
        trainable=sum(p.numel() for p in params), layers=ARCH["num_hidden_layers"],
        bench="train_step", impl="whetstone", config=config, vram_budget_gib=budget,
        kept_layers=kept, offload=offload, step_times=[round(t, 4) for t in times],
        device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
        commit=_commit(), call_id=os.environ.get("CALL_ID", ""),
        gc_freeze=bool(os.environ.get("BENCH_GC_FREEZE")), gc_ms_collections=gc_ms,
        fast_launch=os.environ.get("WHETSTONE_FAST_LAUNCH", "1") == "1",
        issue_s=[round(t, 4) for t in issue],
        fwd_issue_s=round(phases[0], 4), fwd_s=round(phases[1], 4),
        bwd_issue_s=round(phases[2], 4), bwd_s=round(phases[3], 4),
        torch=torch.__version__)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("config", choices=["qlora", "lora"])
    ap.add_argument("seq", type=int)
    ap.add_argument("bs", type=int)
    ap.add_argument("steps", type=int)
    ap.add_argument("--budget", type=float, default=None, help="VRAM budget in GiB")
    ap.add_argument("--no-offload", action="store_true")
    ap.add_argument("--rows", type=int, default=0,
                    help="padding-free steps of ROWS real-like row lengths (module docstring)")
    a = ap.parse_args(argv)
    if a.rows and a.bs != 1:
        ap.error("--rows packs one sequence a step: bs must be 1")
    res = run(a.config, a.seq, a.bs, a.steps, a.budget, not a.no_offload, a.rows)
    print("RESULT", json.dumps(res), flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "train_step.jsonl"), "a") as fh:
        fh.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
