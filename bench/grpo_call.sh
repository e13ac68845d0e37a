#!/usr/bin/env bash
# One device call: our GRPO step (bench/grpo_step.py) beside the Unsloth GRPO anchor
# (../shared/bench/grpo_anchor.py), same machine, same protocol (../shared/BENCHMARKS.md).
# Needs carried along: .whl_engine (../shared/tools/offline-wheels.sh: bitsandbytes, trl, datasets,
# unsloth, ...), .whl_grpo (pydantic & co. for app.store.specs) and .anchors (a copy of ../shared/bench).
# Every stage has a timeout inside CALL_LIMIT_S (default 400 s) so the whole call ends in time;
# 1024 + 1024 runs only with the time left. Logs and JSON under $OUT: grpo.jsonl (ours),
# results.jsonl (anchor), grpo_rows.jsonl (both, in our row format); a summary table last.
#   WHETSTONE_COMMIT=$(git rev-parse --short=12 HEAD) CALL_ID=... bash bench/grpo_call.sh
set -u
LIMIT=${CALL_LIMIT_S:-400}
export PYTHONUNBUFFERED=1 CALL_ID=${CALL_ID:-grpo-$(date +%s)} OUT=${OUT:-/tmp/grpo-out}
export WHETSTONE_COMMIT=${WHETSTONE_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
# seconds for a stage: what it wants, or what is left before the limit (minus 15 s for the summary)
tmo() { local l=$((LIMIT - SECONDS - 15)); if ((l < $1)); then echo $((l > 0 ? l : 1)); else echo "$1"; fi; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl_engine/*.whl .whl_grpo/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "t=${SECONDS}s commit=$WHETSTONE_COMMIT call_id=$CALL_ID"

w() {  # ours: LOGNAME TIMEOUT ARGS...
  local log="$OUT/log_w_$1.txt" t; t=$(tmo "$2"); shift 2
  echo "=== whetstone grpo_step.py $* (timeout ${t}s, t=${SECONDS}s)"
  timeout "$t" python3 bench/grpo_step.py "$@" > "$log" 2>&1
  local rc=$?; grep -E "^(STEP|engine:)" "$log"; grep RESULT "$log" || { echo "rc=$rc"; tail -25 "$log"; }
}
w 256 160 --prompt-len 256 --completion-len 256 --num-generations 8 --steps 4

echo "=== anchors.py make (t=${SECONDS}s)"
timeout "$(tmo 100)" python3 .anchors/anchors.py make > "$OUT/log_make.txt" 2>&1 || tail -15 "$OUT/log_make.txt"
tail -1 "$OUT/log_make.txt"
t=$(tmo 170); echo "=== anchor unsloth_qlora 256 256 8 4 (timeout ${t}s, t=${SECONDS}s)"
timeout "$t" python3 .anchors/grpo_anchor.py unsloth_qlora 256 256 8 4 > "$OUT/log_unsloth_256.txt" 2>&1
rc=$?; grep RESULT "$OUT/log_unsloth_256.txt" || { echo "rc=$rc"; tail -25 "$OUT/log_unsloth_256.txt"; }

if (( LIMIT - SECONDS - 15 > 110 )); then
  w 1024 600 --prompt-len 1024 --completion-len 1024 --num-generations 8 --steps 2
else
  echo "=== 1024 + 1024 skipped: $((LIMIT - SECONDS))s left"
fi

echo "=== summary (t=${SECONDS}s)"
GPU="$GPU" python3 - <<'EOF'
import datetime, json, os
out = os.environ["OUT"]
def rows(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p) if l.strip()] if os.path.exists(p) else []
ours = rows("grpo.jsonl")
anchor = []
for r in rows("results.jsonl"):
    if r.get("bench") != "grpo":
        continue
    impl = r["cfg"].split("_")[0]
    r.update(impl=impl, config="qlora", device=os.environ.get("GPU", ""),
             date=datetime.date.today().isoformat(), commit=os.environ["WHETSTONE_COMMIT"],
             call_id=os.environ["CALL_ID"], note="../shared/bench/grpo_anchor.py, same call, same machine")
    anchor.append(r)
with open(os.path.join(out, "grpo_rows.jsonl"), "w") as fh:
    for r in anchor + ours:
        fh.write(json.dumps(r) + "\n")
ref = {(r["prompt_len"], r["completion_len"]): r for r in anchor if r["impl"] == "unsloth"}
print("| impl | prompt+completion | gens | steps | step s | peak alloc GiB | peak reserved GiB | vs Unsloth step | target <= 0.67x at <= its peak |")
print("|---|---|---|---|---|---|---|---|---|")
for r in anchor + ours:
    u = ref.get((r["prompt_len"], r["completion_len"]))
    ratio = verdict = ""
    if u and r is not u:
        ratio = f"{r['step_s'] / u['step_s']:.2f}x"
        ok = r["step_s"] <= 0.67 * u["step_s"] and r["peak_alloc_gib"] <= u["peak_alloc_gib"]
        verdict = "met" if ok else "missed"
    print(f"| {r['impl']} | {r['prompt_len']}+{r['completion_len']} | {r['num_generations']} | {r['steps']} "
          f"| {r['step_s']} | {r['peak_alloc_gib']} | {r['peak_reserved_gib']} | {ratio} | {verdict} |")
EOF
echo "done t=${SECONDS}s"
