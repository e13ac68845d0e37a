"""The longest sequence that trains (issue 17 part 2): QLoRA Llama-3.1-8B (random weights), batch 1,
one step = forward with labels + backward + AdamW step completes, within an 80 GiB allocator
budget (``torch.cuda.set_per_process_memory_fraction(80 GiB / total)``), one impl per process:

* ``whetstone``: the engine as bench/train_step.py builds it (NF4, LoRA r=16 on the 7
  projections, fused kernels, offloaded checkpointing to pinned host memory, no budget);
* ``unsloth``: as ../shared/bench/anchors.py builds it (FastLanguageModel load_in_4bit, r=16,
  use_gradient_checkpointing="unsloth") from the sft17_data model folder.

Search (one step per probe, OOM caught: torch.cuda.OutOfMemoryError or a RuntimeError saying
"out of memory", then gc + empty_cache; any other failure is recorded and ends the search),
after one untimed warm-up step (--warmup tokens, compile and autotune): probes at --ladder lengths (default 16k, 32k, 64k) give
peak GiB = a + b L and step seconds = c L + d L^2 (least squares); the next probe is the length
the fit predicts for 97 % of the budget, rounded down to 1,024; then bisection between the
longest success and the shortest failure until they are within --resolution tokens. A probe the
time fit says will not finish inside the remaining --time-cap, or whose host memory (max RSS,
fitted linearly; offloaded activations live there) would pass 90 % of MemTotal, is not run: the
row then says ``capped`` and max_seq is "at least". Every probe prints a ``PROBE {json}`` line
as it ends (they survive a kill).

    python3 bench/max_context.py --impl whetstone [--budget-gib 80] [--time-cap 300]
    python3 bench/max_context.py --impl unsloth
    python3 bench/max_context.py --impl whetstone --fake     # CPU check of the search

Row (bench="max_context", impl, max_seq, tokens_per_s at max_seq, peak_alloc_gib there, capped,
first_failure: length + the OOM message + the innermost frames of where it broke, probes, fits,
device, date, commit, call_id) printed as ``RESULT {json}`` and appended to $OUT/results.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[k] = "1"
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")


def host_total_gib() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def build(impl: str, max_seq: int):
    """(model, optimizer) of ``impl`` on the GPU."""
    import torch

    if impl == "whetstone":
        import train_step

        pm = train_step.build("qlora", None, True)
    else:
        import unsloth  # noqa: F401  (before transformers)
        from unsloth import FastLanguageModel

        import sft17_data

        pm, _ = FastLanguageModel.from_pretrained(
            sft17_data.model_dir(False), max_seq_length=max_seq, dtype=torch.bfloat16,
            load_in_4bit=True, local_files_only=True)
        pm = FastLanguageModel.get_peft_model(
            pm, r=16, target_modules=sft17_data.TARGETS, lora_alpha=16, lora_dropout=0,
            bias="none", use_gradient_checkpointing="unsloth", random_state=3407)
    pm.train()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=2e-4)
    torch.cuda.empty_cache()
    return pm, opt


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc).lower()
                                           or "CUBLAS_STATUS_ALLOC_FAILED" in str(exc)))


def where(exc: BaseException) -> list[str]:
    """The innermost frames of the traceback: file:line function."""
    return [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
            for f in traceback.extract_tb(exc.__traceback__)[-5:]]


def real_step(pm, opt):
    import torch

    def step(n: int) -> dict:
        torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, 32000, (1, n), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = None
        try:
            out = pm(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            torch.cuda.synchronize()
            return {"ok": True, "step_s": time.perf_counter() - t0,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "loss": float(out.loss)}
        except Exception as exc:  # noqa: BLE001 - OOM, or whatever else broke (RoPE tables...)
            return {"ok": False, "oom": is_oom(exc), "step_s": time.perf_counter() - t0,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "error": f"{type(exc).__name__}: " + " ".join(str(exc).split())[:600],
                    "where": where(exc)}
        finally:
            del out, ids
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
    return step


def fake_step(budget: float):
    """``--fake``: 5 GiB + 0.5 MiB a token, 20 us a token (+ a quadratic part); OOM above budget."""
    def step(n: int) -> dict:
        peak = 5 + n * 0.5 / 1024
        t = n * 2e-5 + (n / 1e5) ** 2 * float(os.environ.get("FAKE_QUAD", "0.01"))
        time.sleep(t if peak <= budget else t / 2)
        if peak > budget:
            return {"ok": False, "oom": True, "step_s": t / 2, "peak_gib": budget,
                    "error": f"fake OOM at {n}: Tried to allocate {n / 2048:.2f} GiB",
                    "where": ["max_context.py fake_step"]}
        return {"ok": True, "step_s": t, "peak_gib": peak, "loss": 11.0}
    return step


def fit_line(xs, ys):
    """(a, b) of y = a + b x, least squares (b = 0 for one point)."""
    n = len(xs)
    if n < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def predict_time(probes, n: int) -> float:
    """Step seconds at ``n`` from t/L = c + d L over the successful probes (never below linear)."""
    ok = [p for p in probes if p["ok"]]
    if not ok:
        return 0.0
    c, d = fit_line([p["seq"] for p in ok], [p["step_s"] / p["seq"] for p in ok])
    return max(n * (c + d * n), n * ok[-1]["step_s"] / ok[-1]["seq"])


def search(step, budget: float, ladder: list[int], cap_s: float, resolution: int,
           host_limit_gib: float, rss_gib) -> dict:
    """Ladder, linear extrapolation, then bisection (see the module docstring)."""
    t_end = time.monotonic() + cap_s
    probes: list[dict] = []
    capped = None

    def probe(n: int) -> dict | None:
        nonlocal capped
        left = t_end - time.monotonic()
        need = predict_time(probes, n) * 1.3
        ok = [p for p in probes if p["ok"]]
        if probes and need > left:
            capped = f"time: a {n}-token probe needs ~{need:.0f}s, {left:.0f}s left"
            return None
        if len(ok) >= 2 and host_limit_gib:
            ha, hb = fit_line([p["seq"] for p in ok], [p["host_gib"] for p in ok])
            if ha + hb * n > host_limit_gib:
                capped = f"host memory: ~{ha + hb * n:.0f} GiB predicted at {n} tokens"
                return None
        r = step(n)
        r.update(seq=n, host_gib=round(rss_gib(), 2), step_s=round(r["step_s"], 3),
                 peak_gib=round(r["peak_gib"], 3))
        print("PROBE", json.dumps(r), flush=True)
        probes.append(r)
        if not r["ok"] and not r.get("oom", True):  # not memory: the process may be unusable
            capped = f"stopped: a non-OOM failure at {n} tokens"
        return r

    for n in ladder:
        r = probe(n)
        if r is None or not r["ok"]:
            break
    while capped is None:
        ok = [p for p in probes if p["ok"]]
        bad = [p for p in probes if not p["ok"]]
        lo = max((p["seq"] for p in ok), default=0)
        hi = min((p["seq"] for p in bad), default=None)
        if hi is not None and hi - lo <= resolution:
            break
        if hi is None:
            a, b = fit_line([p["seq"] for p in ok], [p["peak_gib"] for p in ok])
            guess = int((0.97 * budget - a) / b) if b > 0 else lo * 2
            n = max(lo + resolution, min(guess, lo * 4)) // 1024 * 1024
            fits = n
            while fits > lo and predict_time(probes, fits) * 1.3 > t_end - time.monotonic():
                fits = (fits * 7 // 8) // 1024 * 1024
            if fits < n:  # the time left cannot verify the memory fit: the longest it can
                if fits > lo + resolution:
                    probe(fits)
                capped = capped or (f"time: the memory fit predicts {guess} tokens; a step "
                                    f"there needs ~{predict_time(probes, n):.0f}s")
                break
        else:
            n = (lo + hi) // 2 // 1024 * 1024
            if n <= lo:
                break
        if probe(n) is None:
            break
    ok = [p for p in probes if p["ok"]]
    best = max(ok, key=lambda p: p["seq"]) if ok else None
    bad = sorted((p for p in probes if not p["ok"]), key=lambda p: p["seq"])
    a, b = fit_line([p["seq"] for p in ok], [p["peak_gib"] for p in ok]) if ok else (0, 0)
    ha, hb = fit_line([p["seq"] for p in ok], [p["host_gib"] for p in ok]) if ok else (0, 0)
    return {"predicted_max_seq_gpu": int((budget - a) / b) if b > 0 else None,
            "predicted_max_seq_host": int((host_limit_gib - ha) / hb) if hb > 0 else None,
            "fit_host_gib": {"a": round(ha, 3), "b_per_1k_tokens": round(hb * 1024, 5)},"max_seq": best["seq"] if best else 0,
            "tokens_per_s": round(best["seq"] / best["step_s"], 1) if best else None,
            "step_s": best["step_s"] if best else None,
            "peak_alloc_gib": best["peak_gib"] if best else None,
            "host_gib": best["host_gib"] if best else None,
            "capped": capped, "at_least": capped is not None,
            "first_failure": bad[0] if bad else None,
            "fit_peak_gib": {"a": round(a, 3), "b_per_1k_tokens": round(b * 1024, 5)},
            "probes": probes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["whetstone", "unsloth"], required=True)
    ap.add_argument("--budget-gib", type=float, default=80.0)
    ap.add_argument("--ladder", default="16384,32768,65536")
    ap.add_argument("--time-cap", type=float, default=300.0, help="seconds for the probes")
    ap.add_argument("--resolution", type=int, default=4096, help="tokens")
    ap.add_argument("--max-seq", type=int, default=524_288, help="Unsloth's max_seq_length")
    ap.add_argument("--warmup", type=int, default=4096, help="tokens of the untimed first step")
    ap.add_argument("--fake", action="store_true", help="simulated steps (CPU check)")
    a = ap.parse_args(argv)
    ladder = [int(x) for x in a.ladder.split(",")]
    host_total = host_total_gib()
    t0 = time.monotonic()
    row: dict = {}
    device = "fake"
    try:
        if a.fake:
            step = fake_step(a.budget_gib)
        else:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("max_context needs a CUDA GPU (use --fake for the CPU check)")
            device = torch.cuda.get_device_name()
            total = torch.cuda.get_device_properties(0).total_memory / 2**30
            pm, opt = build(a.impl, a.max_seq)
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.budget_gib / total), 0)
            row["mem_after_load_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            step = real_step(pm, opt)
            row["warmup"] = step(a.warmup)  # compile/autotune outside the timed probes
            print("WARMUP", json.dumps(row["warmup"]), flush=True)
        row["load_s"] = round(time.monotonic() - t0, 1)

        def rss_gib() -> float:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

        row.update(search(step, a.budget_gib, ladder, a.time_cap, a.resolution,
                          0.9 * host_total, rss_gib))
        row["state"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the row says what broke
        row.update(state="error", error=f"{type(exc).__name__}: {exc}"[:1500], where=where(exc))
    row = dict(bench="max_context", impl=a.impl, max_seq=row.pop("max_seq", None),
               tokens_per_s=row.pop("tokens_per_s", None),
               peak_alloc_gib=row.pop("peak_alloc_gib", None), budget_gib=a.budget_gib,
               host_total_gib=round(host_total, 1), **row, fake=a.fake, device=device,
               seconds=round(time.monotonic() - t0, 1), date=datetime.date.today().isoformat(),
               commit=os.environ.get("WHETSTONE_COMMIT", ""),
               call_id=os.environ.get("CALL_ID", ""))
    print("RESULT", json.dumps(row), flush=True)
    if not a.fake:
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "results.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0 if row.get("state") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
