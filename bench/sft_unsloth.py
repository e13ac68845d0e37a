"""Unsloth's SFTTrainer on the same token rows as bench/sft_job.py (issue 17 part 1), impl "unsloth".

Same model folder (bench/sft17_data.py: random-weight Llama-3.1-8B, llama2 tokenizer), same rows
given PRE-TOKENISED: ``tokens_<seq>.jsonl`` holds each row's ``input_ids`` and ``labels``
(-100 on untrained tokens) exactly as the worker's train job encodes them (worker.engine.data
.build_dataset, the studio's chat template), so TRL skips its tokenisation and uses the labels
as they are. Unsloth as ../shared/bench/anchors.py runs it: FastLanguageModel.from_pretrained
(load_in_4bit, bf16, local_files_only), get_peft_model r=16 alpha=16 dropout 0 on the 7
projections, use_gradient_checkpointing="unsloth"; then TRL's SFTTrainer (patched by Unsloth)
with the job's arguments: max_length = max_seq_length, gradient_accumulation_steps 1, lr 2e-4,
warmup 0.03, linear, adamw_torch, seed 3407, logging_steps 1, one epoch (or --max-steps), no
checkpoint saving, include_num_input_tokens_seen="non_padding".

Modes: ``packing`` (packing=True: TRL BFD, padding-free), ``padding_free`` (padding_free=True),
``default`` (both off: each batch padded to its longest row). Unsloth's best settings are the
first two (Unsloth turns padding_free on by itself when it is left unset).

Per mode, in its own process (so each peak is its own): real tokens/s = the epoch's tokens (every
row's input_ids; TRL's num_input_tokens_seen is kept as tokens_seen, and used with --max-steps)
/ the trainer.train wall time (wall_s); peak_alloc_gib = torch.cuda.max_memory_allocated()
since the process started (the job's peak also counts its load).

    python3 bench/sft_unsloth.py --seq 2048 --mode packing [--bs 8] [--packing-bs 4] [--max-steps N]
    python3 bench/sft_unsloth.py --seq 512 --mode packing --tiny --dry   # CPU: args + dataset only

Without CUDA, Unsloth cannot import: the script prints a RESULT row with state "error" and the
reason and exits 1. ``--dry`` builds the dataset and the SFTConfig with plain TRL (no Unsloth).
Appends rows (bench="sft_job", impl="unsloth", mode, max_seq_length, rows, real_tokens_per_s,
wall_s, peak_alloc_gib, device, date, commit, call_id) to $OUT/results.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[k] = "1"
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")

import sft17_data  # noqa: E402  (no torch/transformers import at module level)


def sft_args(mode: str, a, out_dir: str):
    """The SFTConfig (same arguments as the job's worker.engine.sft.sft_config)."""
    from trl import SFTConfig

    bs = a.packing_bs if mode == "packing" else a.bs
    return SFTConfig(
        # rows are already truncated to max_seq_length; TRL refuses max_length with
        # padding_free and no packing (the job passes None there too)
        output_dir=out_dir, max_length=None if mode == "padding_free" else a.seq,
        packing=mode == "packing",
        padding_free=mode == "padding_free", per_device_train_batch_size=bs,
        gradient_accumulation_steps=1, learning_rate=2e-4, num_train_epochs=1.0,
        max_steps=a.max_steps, warmup_steps=0.03, lr_scheduler_type="linear", weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", seed=3407, data_seed=3407, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, bf16=not a.dry,
        use_cpu=a.dry, include_num_input_tokens_seen="non_padding", dataloader_num_workers=0,
        dataset_num_proc=1)


def dataset(path: str):
    from datasets import Dataset

    return Dataset.from_list(sft17_data.load_tokens(path))


def train(mode: str, a, tokens_path: str, mdir: str) -> dict:
    import torch

    if a.dry:  # the CPU check: the same dataset and SFTConfig through plain TRL + PEFT
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer
        from trl import SFTTrainer

        class CpuSFTTrainer(SFTTrainer):  # TRL's fused LM-head loss needs a GPU (as in the job)
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return Trainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)

        ds = dataset(tokens_path)
        a.max_steps = 2
        args = sft_args(mode, a, tempfile.mkdtemp(prefix="sft-unsloth-"))
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32),
                               LoraConfig(r=16, lora_alpha=16, target_modules=sft17_data.TARGETS,
                                          task_type="CAUSAL_LM"))
        tok = AutoTokenizer.from_pretrained(mdir)
        tok.pad_token = tok.pad_token or tok.unk_token
        trainer = CpuSFTTrainer(model=model, processing_class=tok, train_dataset=ds, args=args)
        trainer.train()
        return {"state": "dry", "rows": len(ds), "padding_free": args.padding_free,
                "packing": args.packing, "batch_size": args.per_device_train_batch_size,
                "steps": trainer.state.global_step,
                "tokens": int(trainer.state.num_input_tokens_seen or 0)}
    if not torch.cuda.is_available():
        raise RuntimeError("Unsloth needs a CUDA GPU (none here)")
    import unsloth  # noqa: F401  (must come before transformers and trl)
    from unsloth import FastLanguageModel

    t_load = time.monotonic()
    model, tok = FastLanguageModel.from_pretrained(
        mdir, max_seq_length=a.seq, dtype=torch.bfloat16, load_in_4bit=True,
        local_files_only=True)
    model = FastLanguageModel.get_peft_model(
        model, r=16, target_modules=sft17_data.TARGETS, lora_alpha=16, lora_dropout=0,
        bias="none", use_gradient_checkpointing="unsloth", random_state=3407)
    from trl import SFTTrainer

    ds = dataset(tokens_path)
    args = sft_args(mode, a, tempfile.mkdtemp(prefix="sft-unsloth-"))
    trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=ds, args=args)
    load_s = time.monotonic() - t_load
    t0 = time.monotonic()
    out = trainer.train()
    torch.cuda.synchronize()
    runtime = time.monotonic() - t0
    seen = int(trainer.state.num_input_tokens_seen or 0)
    # a whole epoch: every row's tokens (TRL counts tokens != pad_token_id without an attention
    # mask, and Unsloth may make the pad token a real one); else what TRL counted
    tokens = sum(len(r) for r in ds["input_ids"]) if a.max_steps < 0 else seen
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"state": "succeeded", "rows": len(ds), "steps": trainer.state.global_step,
            "tokens": tokens, "tokens_seen": seen, "real_tokens_per_s": round(tokens / runtime, 1),
            "wall_s": round(runtime, 3), "train_runtime_hf": out.metrics.get("train_runtime"),
            "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
            "load_s": round(load_s, 1), "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "batch_size": args.per_device_train_batch_size,
            "padding_free_used": bool(getattr(trainer, "padding_free", args.padding_free)),
            "packing": args.packing, "device": torch.cuda.get_device_name(),
            "versions": {"unsloth": getattr(unsloth, "__version__", "?"),
                         "torch": torch.__version__}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mode", choices=["default", "packing", "padding_free"], default="packing")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--packing-bs", type=int, default=None,
                    help="packed rows of max_seq_length per batch (default 8192 // seq, >= 1)")
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--limit", type=int, default=None, help="rows (0 all; --tiny: 40)")
    ap.add_argument("--dry", action="store_true", help="dataset + SFTConfig only (no Unsloth)")
    a = ap.parse_args(argv)
    a.packing_bs = a.packing_bs or max(1, 8192 // a.seq)
    rows_path = sft17_data.build_rows(sft17_data.limit_rows(a.limit, a.tiny))
    tokens_path = rows_path.replace(".jsonl", f".tokens_{a.seq}.jsonl")
    mdir = sft17_data.model_dir(a.tiny)
    row = {}
    try:
        if not (os.path.isfile(tokens_path) and os.path.isfile(os.path.join(mdir, "config.json"))):
            raise RuntimeError(f"run `python3 bench/sft17_data.py prep --seqs {a.seq}` first "
                               f"(no {tokens_path} or {mdir})")
        row = train(a.mode, a, tokens_path, mdir)
    except Exception as exc:  # noqa: BLE001 - the row says what broke
        row = {"state": "error", "error": f"{type(exc).__name__}: {exc}"[:1500]}
    row = dict(bench="sft_job", impl="unsloth", mode=a.mode, max_seq_length=a.seq,
               rows=row.pop("rows", None), real_tokens_per_s=row.pop("real_tokens_per_s", None),
               wall_s=row.pop("wall_s", None), peak_alloc_gib=row.pop("peak_alloc_gib", None),
               **row, lengths=sft17_data.lengths(tokens_path) if os.path.isfile(tokens_path)
               else None, tiny=a.tiny, date=datetime.date.today().isoformat(),
               commit=os.environ.get("WHETSTONE_COMMIT", ""),
               call_id=os.environ.get("CALL_ID", ""))
    row.setdefault("device", "none")
    print("RESULT", json.dumps(row), flush=True)
    if not a.dry:
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "results.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0 if row["state"] in ("succeeded", "dry") else 1


if __name__ == "__main__":
    sys.exit(main())
