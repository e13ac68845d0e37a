"""Shared inputs of the issue-17 benchmarks (bench/sft_job.py, bench/sft_unsloth.py,
bench/max_context.py): the random-weight model folder, the real SFT rows and their tokens.

* ``model``: Llama-3.1-8B architecture (bench/train_step.py ARCH) with random bf16 weights, saved
  as an HF folder with a REAL tokenizer: ../shared/data/tokenizers/llama2-sentencepiece converted
  to ``tokenizer.json`` (carried in ``.whl_bench/tok-llama2``; made with transformers'
  LlamaTokenizer + protobuf). Its ids (< 32,000) lie inside the 8B vocabulary (128,256), so the
  mapping of ids into the 8B vocabulary is the identity; bos/eos are the tokenizer's (1/2).
  ``--tiny``: 2 layers, hidden 64, vocab 32,000 (the CPU check).
* ``rows.jsonl``: one ``messages`` file of real rows of ``<seed>/sft`` (seed: $WHETSTONE_SEED_DIR,
  else ./.seed, else ../shared/data): alpaca_en_demo + identity_alpaca + oasst1_en_100_alpaca
  (alpaca rows as a user turn ``instruction\\n\\ninput`` and an assistant turn ``output``), every
  root-to-leaf conversation of oasst1_en_100_trees (not deleted) and oasst_conversation_sharegpt.
  Tool-call rows (glaive) are left out.
* ``tokens_<seq>.jsonl``: the rows as the train job encodes them (worker.engine.data
  .build_dataset with the chat template the studio resolves for this model: the model has
  none, so the built-in default), ``input_ids`` + ``labels`` (-100 on untrained tokens): the
  exact token rows both benchmarks train on.

    python3 bench/sft17_data.py prep [--tiny] [--seqs 2048,4096]   # idempotent; prints lengths
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORK = os.environ.get("SFT17_DIR", "/tmp/sft17")
TOK_DIR = os.environ.get("SFT17_TOKENIZER", os.path.join(REPO, ".whl_bench", "tok-llama2"))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32000)


def model_dir(tiny: bool) -> str:
    return os.path.join(WORK, "model-tiny" if tiny else "model-8b")


def arch(tiny: bool) -> dict:
    sys.path.insert(0, HERE)
    import train_step

    a = {**train_step.ARCH, "bos_token_id": 1, "eos_token_id": 2}
    return {**a, **TINY} if tiny else a


def seed_dir() -> str:
    for d in (os.environ.get("WHETSTONE_SEED_DIR"), os.path.join(REPO, ".seed"),
              os.path.join(os.path.dirname(REPO), "shared", "data")):
        if d and os.path.isdir(os.path.join(d, "sft")):
            return d
    raise SystemExit("no seed dir with sft/ (set WHETSTONE_SEED_DIR)")


def make_model(tiny: bool) -> str:
    """Write the random-weight model folder once (bf16; made on the GPU when there is one)."""
    out = model_dir(tiny)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    torch.manual_seed(0)
    cfg = LlamaConfig(**arch(tiny))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.config.torch_dtype = torch.bfloat16
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the jobs this process starts get the memory back
    for f in os.listdir(TOK_DIR):
        shutil.copy(os.path.join(TOK_DIR, f), tmp)
    os.replace(tmp, out)
    print(f"made {out} in {time.time() - t0:.0f}s", flush=True)
    return out


def _alpaca(r: dict) -> dict:
    user = r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": r["output"]}]}


def _paths(node: dict, prefix: list) -> list:
    if node.get("deleted"):
        return []
    turn = prefix + [{"role": "user" if node["role"] == "prompter" else "assistant",
                      "content": node["text"]}]
    kids = [p for c in node.get("replies") or [] for p in _paths(c, turn)]
    if kids:
        return kids
    return [turn] if turn[-1]["role"] == "assistant" else [turn[:-1]] if len(turn) > 1 else []


def build_rows(limit: int | None = None) -> str:
    """The combined rows file (see the module docstring); returns its path."""
    out = os.path.join(WORK, f"rows{limit or ''}.jsonl")
    if os.path.isfile(out):
        return out
    sft = os.path.join(seed_dir(), "sft")
    rows = []
    for f in ("alpaca_en_demo.json", "identity_alpaca.json", "oasst1_en_100_alpaca.json"):
        with open(os.path.join(sft, f)) as fh:
            rows += [_alpaca(r) for r in json.load(fh)]
    with open(os.path.join(sft, "oasst1_en_100_trees.jsonl")) as fh:
        for line in fh:
            rows += [{"messages": p} for p in _paths(json.loads(line)["prompt"], []) if p]
    with open(os.path.join(sft, "oasst_conversation_sharegpt.json")) as fh:
        conv = json.load(fh)
    conv = conv if isinstance(conv, list) else [conv]
    rows += [{"messages": [{"role": "user" if t["from"] == "human" else "assistant",
                            "content": t["value"]} for t in c["conversations"]]} for c in conv]
    if limit:  # the CPU check: a few dozen rows, long and short
        rows = rows[:limit // 2] + rows[-(limit - limit // 2):]
    os.makedirs(WORK, exist_ok=True)
    with open(out + ".tmp", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(out + ".tmp", out)
    return out


def encode(rows_path: str, mdir: str, seq: int) -> str:
    """The rows encoded as the train job encodes them (``tokens_<seq>.jsonl``); returns the path."""
    out = rows_path.replace(".jsonl", f".tokens_{seq}.jsonl")
    if os.path.isfile(out):
        return out
    sys.path.insert(0, REPO)
    from app.data.chat_template import choose_template
    from app.data.encode import load_tokenizer_bundle
    from worker.engine.data import build_dataset

    _, template = choose_template(None, load_tokenizer_bundle(mdir).chat_template)
    enc = build_dataset(rows_path, mdir, template, seq, True)
    with open(out + ".tmp", "w") as fh:
        for ids, labels in zip(enc.dataset["input_ids"], enc.dataset["labels"]):
            fh.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
    os.replace(out + ".tmp", out)
    return out


def load_tokens(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def lengths(path: str) -> dict:
    """Length distribution of the token rows (tokens, trained tokens, percentiles)."""
    rows = load_tokens(path)
    ls = sorted(len(r["input_ids"]) for r in rows)

    def pct(p):
        return ls[min(len(ls) - 1, int(p * len(ls)))]

    return {"rows": len(ls), "tokens": sum(ls),
            "trained": sum(sum(x != -100 for x in r["labels"]) for r in rows),
            "min": ls[0], "p10": pct(0.1), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "max": ls[-1], "mean": round(sum(ls) / len(ls), 1)}


def prep(tiny: bool, seqs: list[int], limit: int | None = None) -> dict:
    """Model folder, rows file and token rows for each max_seq_length (all idempotent)."""
    mdir = make_model(tiny)
    rows = build_rows(limit)
    return {"model_dir": mdir, "rows": rows,
            "tokens": {s: encode(rows, mdir, s) for s in seqs}}


def limit_rows(limit: int | None, tiny: bool) -> int | None:
    """Rows to use: ``limit`` (0 = all), else 40 for the tiny CPU check, else all."""
    return (limit or None) if limit is not None else (40 if tiny else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["prep"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--seqs", default="2048,4096")
    ap.add_argument("--limit", type=int, default=None, help="rows (default: all; 40 with --tiny; "
                    "0: all)")
    a = ap.parse_args(argv)
    p = prep(a.tiny, [int(s) for s in a.seqs.split(",")], limit_rows(a.limit, a.tiny))
    for s, path in p["tokens"].items():
        print("LENGTHS", json.dumps({"max_seq_length": s, **lengths(path)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
