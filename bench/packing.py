"""Packing benchmark (issue 15): N QLoRA training jobs admitted onto ONE GPU at once by the real
supervisor (``python -m worker --supervise``: admission by estimated memory, one child process per
job, allocator capped at the admitted memory, vram_budget_gib = admitted - CUDA context), against
one job alone on the same GPU.

Each job is the train_step benchmark's step (bench/train_step.py: the model architecture with
random bf16 weights made on the GPU, NF4, LoRA r=16 on the 7 projections, AdamW, checkpointing,
random tokens), run as a queue job of kind ``bench_step`` whose estimate is
``app.studio.estimate`` for that spec, so admission decides as it does for a studio run.

    python3 bench/packing.py --model llama-3.1-8b --jobs 4 --seq 2048 --bs 2 --steps 80
    python3 bench/packing.py --model llama-3.2-1b --jobs 4 --seq 2048 --bs 2 --steps 120

single_tokens_per_s: the one job alone (median step). aggregate_tokens_per_s: tokens of every
job's steps inside the window where all N jobs were stepping, over that window's length. peaks:
each job's allocator peak (GiB) with its admitted GiB; oom: jobs that failed out of memory.
Prints ``RESULT {json}`` and appends the row (bench="packing", model, jobs, single_tokens_per_s,
aggregate_tokens_per_s, ratio, peaks, oom, max_running, device, date, commit, call_id) to
$OUT/results.jsonl (default /tmp).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

MODELS = {  # HF config fields of the benchmark models (random weights: nothing is downloaded)
    "llama-3.1-8b": {},  # train_step.ARCH as it is
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
}


def arch(model: str) -> dict:
    import train_step

    return {**train_step.ARCH, **MODELS[model]}


def estimate_gib(model: str, config: str, seq: int, bs: int, budget: float | None = None) -> float:
    """The studio's allocator estimate (GiB) of one job (what admission packs by)."""
    from app.store.specs import TrainSpec
    from app.studio.estimate import ModelShape, estimate_training
    from train_step import TARGETS

    spec = TrainSpec(model="m", dataset="d", r=16, lora_alpha=16, target_modules=TARGETS,
                     load_in_4bit=config == "qlora", optim="adamw_torch", max_seq_length=seq,
                     per_device_train_batch_size=bs, vram_budget_gib=budget)
    return round(estimate_training(ModelShape.from_config(arch(model)), spec, "train")
                 .allocated_gib, 3)


def run_job(ctx) -> dict:
    """The ``bench_step`` job (runs in a supervisor's child): build, then time ``steps`` steps,
    recording each step's wall-clock end; ``ctx.check()`` between steps."""
    import torch

    import train_step
    from app.studio.estimate import CUDA_CONTEXT_GIB

    p = ctx.payload
    if os.environ.get("BENCH_FAKE"):  # CPU check of the harness: admission, windows, the row
        return fake_job(ctx)
    train_step.ARCH.update(arch(p["model"]))
    budget = round(ctx.job.admitted_gib - CUDA_CONTEXT_GIB, 2) if ctx.job.admitted_gib else None
    # train_step.build makes the random bf16 model on the GPU before quantising it (16 GiB for
    # the 8B shape), which the admitted cap (worker/child.py cap_allocator) cannot hold; a studio
    # job instead loads its weights from disk and quantises them one layer at a time. So the cap
    # is lifted while the random weights are made and quantised, and set again before training;
    # the peak is measured from there (reset_peak_memory_stats below).
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    capped = ctx.job.admitted_gib is not None
    if capped:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    pm = train_step.build(p["config"], budget, True)
    torch.cuda.empty_cache()
    if capped:
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, max(0.05, (ctx.job.admitted_gib - CUDA_CONTEXT_GIB) / total)), 0)
    pm.train()
    opt = torch.optim.AdamW([q for q in pm.parameters() if q.requires_grad], lr=2e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(ctx.job.id)
    batches = [torch.randint(0, 4000, (p["bs"], p["seq"]), device="cuda", generator=g)
               for _ in range(4)]
    torch.cuda.reset_peak_memory_stats()
    starts, ends = [], []
    for step in range(p["steps"]):
        ctx.check()
        ids = batches[step % 4]
        torch.cuda.synchronize()
        starts.append(time.time())
        out = pm(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ends.append(time.time())
    times = sorted(e - s for s, e in zip(starts[2:], ends[2:]))
    peak = torch.cuda.max_memory_allocated() / 2**30
    return {"tokens_per_step": p["bs"] * p["seq"], "starts": starts, "ends": ends,
            "tokens_per_s": round(p["bs"] * p["seq"] / times[len(times) // 2], 1),
            "vram_budget_gib": budget, "device": torch.cuda.get_device_name(),
            "memory_peak": {"kind": "gpu", "peak_gib": round(peak, 4)}}


def fake_job(ctx) -> dict:
    """``BENCH_FAKE=1``: a job that sleeps through its steps (no CUDA), to check the harness."""
    p, starts, ends = ctx.payload, [], []
    for _ in range(p["steps"]):
        ctx.check()
        starts.append(time.time())
        time.sleep(0.05)
        ends.append(time.time())
    return {"tokens_per_step": p["bs"] * p["seq"], "starts": starts, "ends": ends,
            "tokens_per_s": round(p["bs"] * p["seq"] / 0.05, 1), "vram_budget_gib": None,
            "device": "fake", "memory_peak": {"kind": "gpu", "peak_gib": 1.0}}


def serve() -> int:
    """``--serve``: the real supervisor with the ``bench_step`` handler added."""
    from worker import loop
    from worker.__main__ import main

    loop.HANDLERS["bench_step"] = "packing:run_job"
    return main(["--supervise", "--worker-id", "bench", "--poll-interval", "0.5"])


def phase(env: dict, url: str, a, n: int, est: float, log: str, steps: int | None = None) -> dict:
    """Queue ``n`` jobs, start a supervisor, wait for them; returns jobs and max running."""
    from app.store import queue
    from app.store.db import make_engine

    eng = make_engine(url)
    payload = {"model": a.model, "config": a.config, "seq": a.seq, "bs": a.bs,
               "steps": steps or a.steps}
    ids = [queue.enqueue(eng, "bench_step", payload, estimate_gib=est, max_attempts=1).id
           for _ in range(n)]
    with open(log, "ab") as fh:
        sup = subprocess.Popen([sys.executable, __file__, "--serve"], env=env, stdout=fh,
                               stderr=fh)
    max_running, admitted, deadline = 0, {}, time.monotonic() + a.timeout
    try:
        while time.monotonic() < deadline:
            jobs = [queue.get_job(eng, i) for i in ids]
            run = [j for j in jobs if j.state == "running"]
            max_running = max(max_running, len(run))
            admitted.update({j.id: j.admitted_gib for j in run})
            if all(j.state in ("succeeded", "failed", "cancelled") for j in jobs):
                break
            time.sleep(0.5)
    finally:
        sup.terminate()
        sup.wait(180)
    jobs = [queue.get_job(eng, i) for i in ids]
    eng.dispose()
    return {"jobs": jobs, "max_running": max_running, "admitted": admitted}


def aggregate(results: list[dict]) -> tuple[float, float]:
    """(tokens/s over the window where every job was stepping, window seconds)."""
    lo = max(r["starts"][2] for r in results)  # after each job's 2 warm-up steps
    hi = min(r["ends"][-1] for r in results)
    if hi <= lo:
        return 0.0, 0.0
    tokens = sum(r["tokens_per_step"] for r in results
                 for s, e in zip(r["starts"], r["ends"]) if s >= lo and e <= hi)
    return round(tokens / (hi - lo), 1), round(hi - lo, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b")
    ap.add_argument("--config", choices=["qlora", "lora"], default="qlora")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="run one job of this many steps first (Triton autotune cache)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds a phase may take")
    a = ap.parse_args(argv)
    if a.serve:
        return serve()
    from app.store.migrate import upgrade

    out = os.environ.get("OUT", "/tmp")
    tmp = tempfile.mkdtemp(prefix="packing-")
    url = f"sqlite:///{tmp}/whetstone.db"
    upgrade(url)
    env = {**os.environ, "WHETSTONE_DATA_DIR": f"{tmp}/data", "WHETSTONE_DATABASE_URL": url,
           "WHETSTONE_SEED_DIR": f"{tmp}/noseed", "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])}
    est = estimate_gib(a.model, a.config, a.seq, a.bs)
    log = os.path.join(out, f"packing_{a.model}_{a.jobs}.log")
    warm = None
    if a.warmup_steps:  # one job first (admitted with 1.5 x the estimate) so Triton's autotune
        # cache is warm for the measured phases, as on a box that has trained this shape before
        w = phase(env, url, a, 1, round(est * 1.5, 3), log, steps=a.warmup_steps)["jobs"][0]
        warm = {"state": w.state, "peak_gib": w.peak_gib, "admitted_gib": w.admitted_gib,
                "error": (w.error or "")[:300] or None}
        print("WARMUP", json.dumps(warm), flush=True)
    single = phase(env, url, a, 1, est, log)
    packed = phase(env, url, a, a.jobs, est, log)
    ok = [j for j in packed["jobs"] if j.state == "succeeded"]
    oom = sum(1 for j in packed["jobs"] if j.state == "failed"
              and "out of GPU memory" in (j.error or ""))
    one = single["jobs"][0]
    single_tps = (one.result or {}).get("tokens_per_s", 0.0)
    agg, window = aggregate([j.result for j in ok]) if len(ok) == a.jobs else (0.0, 0.0)
    import train_step
    from app.studio.estimate import CUDA_CONTEXT_GIB

    # issue 15's estimator check: each job's allocator peak against the estimate for its spec
    # (raw: as at run creation; with the job's vram_budget_gib, as the engine ran it), and after
    # one calibration run (app.studio.calibration: measured / estimated of the single job).
    def err(e, p):
        return round((e - p) / p, 4) if e and p else None

    factor = one.peak_gib / est if one.peak_gib else None
    estimator = []
    for j in [one] + packed["jobs"]:
        b = round(j.admitted_gib - CUDA_CONTEXT_GIB, 2) if j.admitted_gib else None
        eb = estimate_gib(a.model, a.config, a.seq, a.bs, b) if b else est
        estimator.append(dict(job=j.id, phase="single" if j is one else "packed",
                              peak_gib=j.peak_gib, estimate_gib=est, estimate_budget_gib=eb,
                              vram_budget_gib=b, error=err(est, j.peak_gib),
                              error_budget=err(eb, j.peak_gib),
                              error_calibrated=err(est * factor, j.peak_gib)
                              if factor and j is not one else None))
    row = dict(bench="packing", model=a.model, config=a.config, seq=a.seq, bs=a.bs,
               steps=a.steps, jobs=a.jobs, estimate_gib=est,
               single_tokens_per_s=single_tps, single_peak_gib=one.peak_gib,
               aggregate_tokens_per_s=agg, window_s=window,
               ratio=round(agg / single_tps, 3) if single_tps else None,
               job_tokens_per_s=[(j.result or {}).get("tokens_per_s") for j in packed["jobs"]],
               peaks=[{"job": j.id, "peak_gib": j.peak_gib, "admitted_gib": j.admitted_gib,
                       "within": j.peak_gib is not None and j.admitted_gib is not None
                       and j.peak_gib <= j.admitted_gib} for j in packed["jobs"]],
               oom=oom, failed=[(j.id, j.error) for j in packed["jobs"] if j.state != "succeeded"],
               max_running=packed["max_running"], estimator=estimator,
               calibration_factor=round(factor, 4) if factor else None,
               warmup=warm, single_state=one.state,
               single_error=(one.error or "")[:400] or None,
               device=next((j.result["device"] for j in [one] + packed["jobs"]
                            if j.result and j.result.get("device")), "unknown"),
               date=datetime.date.today().isoformat(), commit=train_step._commit(),
               call_id=os.environ.get("CALL_ID", ""))
    print("RESULT", json.dumps(row), flush=True)
    with open(os.path.join(out, "results.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
