"""The worker's real SFT job on real row lengths (issue 17 part 1), impl "whetstone".

Path: the real queue and the real supervisor. A fresh (or reused) data dir with its SQLite
store; an admin user (app.studio.first_start.ensure_admin); the random-weight Llama-3.1-8B
folder (bench/sft17_data.py: llama2 SentencePiece tokenizer, ids mapped by identity into the
8B vocabulary) registered as a local model (app.studio.models.register_model, imported by the
supervisor's import_model job); the real rows (sft17_data: 1,812 rows, 46..2,809 tokens) uploaded
as a dataset (app.studio.datasets.record_upload, validated by the validate_dataset job); then,
per mode, a run created as the studio creates it (app.studio.runs.create_sft_run with a
TrainSpec) and trained by ``python -m worker --supervise`` (admission by estimated memory, one
child process, worker/jobs/train.py ``run``: TRL SFTTrainer, our callbacks, events in the DB).

Modes: ``default`` (the TrainSpec's defaults: padding-free batches since call s18-c1; padded
before), ``padded`` (padding_free=False: each batch padded to its longest row), ``packing``
(TrainSpec.packing: TRL BFD packing into max_seq_length rows, padding-free), ``padding_free``
(TrainSpec.padding_free=True; a TrainSpec without the field makes these rows ``skipped``). QLoRA (load_in_4bit) r=16
alpha=16 on the 7 projections, gradient_accumulation_steps 1, one epoch (or ``--max-steps``),
save_steps 100000 (no checkpoint inside the timing), everything else the TrainSpec default.

Per mode: real (non-padding) tokens/s = the job result's ``tokens`` (TRL's
num_input_tokens_seen, "non_padding") / its ``train_runtime`` (the trainer.train wall time);
wall_s = train_runtime; job_s = claim to end (load, quantise, adapter save included);
peak_alloc_gib = the result's memory_peak (allocator peak of the child).

    python3 bench/sft_job.py --seq 2048 [--modes padded,packing,padding_free] [--bs 8]
                             [--packing-bs 4] [--max-steps default=100] [--tiny]

``--tiny``: 2 layers, hidden 64, 40 rows, LoRA in fp32 on the CPU (the harness check).
Prints ``LENGTHS`` and ``RESULT {json}`` lines; appends rows (bench="sft_job", impl, mode,
max_seq_length, rows, real_tokens_per_s, wall_s, peak_alloc_gib, device, date, commit
(WHETSTONE_COMMIT), call_id (CALL_ID)) to $OUT/results.jsonl.

``--bare``: the bare engine step on the job's own batches (issue 17: "job path within 10% of the
bare engine step on the same packed batches"), in this process, no supervisor (see ``bare``);
rows bench="sft_bare" with collate_s apart. Compare with the job row of the same mode/seq.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

import sft17_data  # noqa: E402

MODEL_NAME = "llama31-8b-random"
ADMIN, PASSWORD = "admin", "sft-job-bench-password"


def env_for(data_dir: str) -> dict:
    """The environment of the bench process and of its supervisor (same data dir and DB)."""
    return {"WHETSTONE_DATA_DIR": data_dir,
            "WHETSTONE_DATABASE_URL": f"sqlite:///{data_dir}/whetstone.db",
            "WHETSTONE_SEED_DIR": os.path.join(data_dir, "noseed"),  # no demo model import
            "WHETSTONE_IMPORT_ROOT": "/", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def wait(pred, timeout: float, what: str, sup=None, every: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        if sup is not None and sup.poll() is not None:
            raise RuntimeError(f"the supervisor exited ({sup.returncode}) while waiting for {what}")
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def register_inputs(engine, settings, admin, mdir: str, rows_path: str, sup, timeout: float):
    """(model row, dataset row): reused when this data dir has them, else registered as the
    studio registers them and made ready by the supervisor's CPU-lane jobs."""
    from app.store import repo
    from app.studio import datasets, models

    have = [m for m in repo.models_named(engine, MODEL_NAME) if m.name == MODEL_NAME]
    model = have[0] if have else models.register_model(
        engine, settings, admin, {"source": "local", "folder": mdir, "name": MODEL_NAME})
    fname = os.path.basename(rows_path)
    have = [d for d in repo.list_datasets(engine) if d.filename == fname]
    if have:
        ds = have[0]
    else:
        tmp = settings.data_dir / "uploads" / f".incoming-{fname}"
        shutil.copy(rows_path, tmp)
        ds = datasets.record_upload(engine, settings, admin, tmp, fname, os.path.getsize(tmp))
    t0 = time.monotonic()
    model = wait(lambda: (m := repo.get_model(engine, model.id)).status in ("ready", "failed")
                 and m, timeout, "the model import", sup)
    ds = wait(lambda: (d := repo.get_dataset(engine, ds.id)).status != "validating" and d,
              timeout, "the dataset validation", sup)
    if model.status != "ready" or ds.status != "processed":
        raise RuntimeError(f"model {model.status} ({model.error}); dataset {ds.status} "
                           f"({ds.error})")
    return model, ds, round(time.monotonic() - t0, 1)


def spec_for(model_id: str, ds_id: str, mode: str, a, cuda: bool):
    """The run's TrainSpec (None when this TrainSpec has no ``padding_free`` field)."""
    from app.store.specs import TrainSpec

    extra = {}
    if mode == "packing":
        extra["packing"] = True
    if mode in ("padding_free", "padded"):
        if "padding_free" not in TrainSpec.model_fields:
            return None
        extra["padding_free"] = mode == "padding_free"
    bs = a.packing_bs if mode == "packing" else a.bs
    return TrainSpec(model=model_id, dataset=ds_id, load_in_4bit=cuda, r=16, lora_alpha=16,
                     lora_dropout=0.0, target_modules=sft17_data.TARGETS,
                     max_seq_length=a.seq, per_device_train_batch_size=bs,
                     gradient_accumulation_steps=1, max_steps=a.max_steps.get(mode, -1),
                     num_train_epochs=1.0, save_steps=100000, **extra)


def run_mode(engine, settings, admin, model, ds, mode: str, a, cuda: bool, sup) -> dict:
    from app.store import events, queue
    from app.studio.runs import create_sft_run

    spec = spec_for(model.id, ds.id, mode, a, cuda)
    if spec is None:
        return {"state": "skipped", "error": "TrainSpec has no padding_free field (merge main)"}
    run, job = create_sft_run(engine, settings, admin, spec, name=f"bench-{mode}-{a.seq}")
    j = wait(lambda: (x := queue.get_job(engine, job.id)).state in
             ("succeeded", "failed", "cancelled") and x, a.timeout, f"the {mode} run", sup, 1.0)
    res = j.result or {}
    job_s = j.finished_at - j.started_at if j.finished_at and j.started_at else None
    logs = [(e.data or {}).get("message", "") for e in events.recent(engine, job.id, "log", 12)]
    tokens, runtime = res.get("tokens") or 0, res.get("train_runtime") or 0
    peak = (res.get("memory_peak") or {}).get("peak_gib")
    return {"state": j.state, "error": (j.error or "")[:1500] or None, "run_id": run.id,
            "job_id": job.id, "estimate_gib": j.estimate_gib, "admitted_gib": j.admitted_gib,
            "rows": res.get("rows"), "steps": res.get("steps"), "tokens": tokens,
            "real_tokens_per_s": round(tokens / runtime, 1) if runtime else None,
            "wall_s": runtime or None, "job_s": round(job_s, 1) if job_s else None,
            "peak_alloc_gib": round(peak, 3) if peak is not None else None,
            "peak_kind": (res.get("memory_peak") or {}).get("kind"),
            "first_loss": res.get("first_loss"), "final_loss": res.get("final_loss"),
            "batch_size": spec.per_device_train_batch_size, "max_steps": spec.max_steps,
            "log_tail": [m[:300] for m in logs if m][:12]}


def bare(a, modes: list[str], mdir: str, tokens_path: str) -> list[dict]:
    """The bare engine step on the job's own batches: the model loaded and wrapped as the job
    does (worker.engine.sft load_model + add_lora), the SFTTrainer built as the job builds it
    (sft.sft_config + sft.make_trainer, same spec), its train dataloader collated up front
    (collate_s), then per batch forward with labels + backward + the trainer's optimizer step,
    synchronised, with no callbacks, events, logging, scheduler or gradient clipping (the job
    clips at max_grad_norm 1.0). real_tokens_per_s = the
    batches' real tokens (attention_mask sum, else all) / the summed step times (2 warm-up
    steps left out)."""
    import itertools
    import tempfile

    import torch
    from datasets import Dataset

    from worker.engine import sft

    cuda = torch.cuda.is_available() and not a.tiny
    t0 = time.monotonic()
    spec0 = spec_for("m", "d", modes[0], a, cuda).model_copy(
        update={"vram_budget_gib": a.bare_budget})  # the job's: its admitted GiB less context
    model = sft.add_lora(sft.load_model(mdir, spec0.load_in_4bit, cuda), spec0)
    tok = sft.load_tokenizer(mdir, None)
    load_s = time.monotonic() - t0
    ds = Dataset.from_list(sft17_data.load_tokens(tokens_path))
    out = []
    for mode in modes:
        spec = spec_for("m", "d", mode, a, cuda)
        args = sft.sft_config(spec, tempfile.mkdtemp(prefix="bare-"), cuda, "adamw_torch",
                              **({"gradient_checkpointing": False} if sft.use_engine(cuda)
                                 else {}))
        trainer = sft.make_trainer(model, tok, ds, args)
        opt = trainer.create_optimizer()
        t1 = time.monotonic()
        batches = list(itertools.islice(trainer.get_train_dataloader(), a.bare_steps))
        collate_s = time.monotonic() - t1
        dev = "cuda" if cuda else "cpu"
        batches = [{k: v.to(dev) for k, v in b.items()} for b in batches]
        model.train()
        times, toks = [], []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for b in batches:
            if cuda:
                torch.cuda.synchronize()
            ts = time.perf_counter()
            loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - ts)
            m = b.get("attention_mask")
            toks.append(int(m.sum()) if m is not None else b["input_ids"].numel())
        tt, tk = sum(times[2:]), sum(toks[2:])
        out.append({"mode": mode, "steps": len(times), "tokens": tk,
                    "real_tokens_per_s": round(tk / tt, 1) if tt else None,
                    "step_s_median": round(sorted(times[2:])[len(times[2:]) // 2], 4)
                    if len(times) > 2 else None,
                    "collate_s": round(collate_s, 2), "load_s": round(load_s, 1),
                    "batch_size": spec.per_device_train_batch_size,
                    "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)
                    if cuda else None})
    return out


def device_name(cuda: bool) -> str:
    if not cuda:
        return "cpu"
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                      text=True, timeout=20)
        return out.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        return "cuda"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--modes", default="default,packing,padding_free")
    ap.add_argument("--bs", type=int, default=8, help="per_device_train_batch_size (rows)")
    ap.add_argument("--packing-bs", type=int, default=None,
                    help="packed rows of max_seq_length per batch (default 8192 // seq, >= 1)")
    ap.add_argument("--max-steps", default="", help="MODE=N,... (default: one epoch)")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds a run may take")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--limit", type=int, default=None, help="rows (0 all; --tiny: 40)")
    ap.add_argument("--data-dir", default=os.path.join(sft17_data.WORK, "studio"))
    ap.add_argument("--bare", action="store_true", help="the bare engine step on the job's "
                    "batches (no supervisor, no job) for --modes; rows bench=sft_bare")
    ap.add_argument("--bare-steps", type=int, default=40)
    ap.add_argument("--bare-budget", type=float, default=None,
                    help="vram_budget_gib of the bare model (a job runs with its admitted GiB "
                    "less the CUDA context; see the job row's admitted_gib)")
    a = ap.parse_args(argv)
    a.packing_bs = a.packing_bs or max(1, 8192 // a.seq)
    a.max_steps = {k: int(v) for k, v in (p.split("=") for p in a.max_steps.split(",") if p)}
    out = os.environ.get("OUT", "/tmp")
    cuda = not a.tiny and shutil.which("nvidia-smi") is not None
    t0 = time.monotonic()
    p = sft17_data.prep(a.tiny, [a.seq], sft17_data.limit_rows(a.limit, a.tiny))
    lengths = sft17_data.lengths(p["tokens"][a.seq])
    print("LENGTHS", json.dumps({"max_seq_length": a.seq, **lengths}), flush=True)
    prep_s = round(time.monotonic() - t0, 1)

    if a.bare:
        for r in bare(a, a.modes.split(","), p["model_dir"], p["tokens"][a.seq]):
            row = dict(bench="sft_bare", impl="whetstone", max_seq_length=a.seq, **r,
                       lengths=lengths, tiny=a.tiny, device=device_name(cuda),
                       date=datetime.date.today().isoformat(),
                       commit=os.environ.get("WHETSTONE_COMMIT", ""),
                       call_id=os.environ.get("CALL_ID", ""))
            print("RESULT", json.dumps(row), flush=True)
            with open(os.path.join(out, "results.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
        return 0
    data_dir = os.path.abspath(a.data_dir + ("-tiny" if a.tiny else ""))
    os.environ.update(env_for(data_dir))
    from app.settings import get_settings
    from app.store.db import make_engine
    from app.store.migrate import upgrade
    from app.studio.first_start import ensure_admin

    settings = get_settings()
    settings.ensure_dirs()
    upgrade(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    admin = ensure_admin(engine, ADMIN, PASSWORD)
    penv = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    if a.tiny:
        penv["CUDA_VISIBLE_DEVICES"] = ""
    log = open(os.path.join(out, f"sft_job_supervisor_{a.seq}.log"), "ab")
    sup = subprocess.Popen([sys.executable, "-m", "worker", "--supervise", "--poll-interval",
                            "0.5", "--worker-id", "bench"], cwd=REPO, env=penv, stdout=log,
                           stderr=subprocess.STDOUT)
    rows = []
    try:
        model, ds, ready_s = register_inputs(engine, settings, admin, p["model_dir"], p["rows"],
                                             sup, a.timeout)
        print(f"model and dataset ready in {ready_s}s (dataset {ds.rows} rows)", flush=True)
        for mode in a.modes.split(","):
            try:
                r = run_mode(engine, settings, admin, model, ds, mode, a, cuda, sup)
            except Exception as exc:  # noqa: BLE001 - the row says what broke; next mode
                r = {"state": "error", "error": f"{type(exc).__name__}: {exc}"[:1500]}
            row = dict(bench="sft_job", impl="whetstone", mode=mode, max_seq_length=a.seq,
                       **{k: r.get(k) for k in ("rows", "real_tokens_per_s", "wall_s",
                                                "peak_alloc_gib")},
                       **{k: v for k, v in r.items() if k not in ("rows", "real_tokens_per_s",
                                                                   "wall_s", "peak_alloc_gib")},
                       dataset_rows=ds.rows, lengths=lengths, prep_s=prep_s,
                       ready_s=ready_s, tiny=a.tiny, device=device_name(cuda),
                       date=datetime.date.today().isoformat(),
                       commit=os.environ.get("WHETSTONE_COMMIT", ""),
                       call_id=os.environ.get("CALL_ID", ""))
            print("RESULT", json.dumps(row), flush=True)
            rows.append(row)
            with open(os.path.join(out, "results.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
    finally:
        sup.send_signal(signal.SIGTERM)
        try:
            sup.wait(120)
        except subprocess.TimeoutExpired:
            sup.kill()
        engine.dispose()
    return 0 if rows and all(r["state"] in ("succeeded", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
