#!/usr/bin/env bash
# A/B of two source trees on the bare engine step, in one device call: runs
# `bench/train_step.py $ARGS` from tree A and tree B in ABBA order, ROUNDS times, one process a
# run, and prints each run's tokens/s and, per round, B's tokens/s over A's (the mean of its two B
# runs over the mean of its two A runs; ABBA cancels a drift that is linear within the round).
# Why: the default job's steps are bound by the host, and runs of the same code in one call
# differ by up to 12 % (bench/RESULTS.md, session 26); one run of each tree resolves nothing.
#   A=.gpu/base B=. ROUNDS=3 ARGS="qlora 2048 1 40 --rows 8" CALL_ID=... bash bench/ab_call.sh
# A and B are tree roots (each with bench/train_step.py); OUT collects the RESULT lines.
set -u
A=${A:?tree A}; B=${B:?tree B}; ROUNDS=${ROUNDS:-3}; ARGS=${ARGS:-qlora 2048 1 40 --rows 8}
OUT=${OUT:-/tmp/ab-out}; LIMIT=${CALL_LIMIT_S:-560}; PY=${PY:-python3}
mkdir -p "$OUT"; : > "$OUT/ab.txt"
T0=$SECONDS
for r in $(seq "$ROUNDS"); do
  for t in A B B A; do
    left=$((LIMIT - (SECONDS - T0)))
    if [ "$left" -lt 60 ]; then echo "stopped: ${left} s left"; break 2; fi
    dir=${!t}
    line=$(cd "$dir" && timeout "$left" env OUT="$OUT" $PY bench/train_step.py $ARGS 2>"$OUT/err_${r}_$t.txt" | grep '^RESULT' | tail -1)
    tps=$(printf '%s' "${line#RESULT }" | $PY -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])' 2>/dev/null || echo nan)
    echo "round $r $t $tps" | tee -a "$OUT/ab.txt"
  done
done
$PY - "$OUT/ab.txt" <<'PY'
import collections, math, statistics, sys
runs = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    _, r, t, v = line.split()
    if v != "nan":
        runs[r][t].append(float(v))
ratios = [statistics.mean(d["B"]) / statistics.mean(d["A"]) for d in runs.values()
          if len(d["A"]) == 2 and len(d["B"]) == 2]
print("B/A per full round:", [round(x, 4) for x in ratios])
if ratios:
    g = math.exp(statistics.mean(math.log(x) for x in ratios))
    print(f"geometric mean B/A {g:.4f} over {len(ratios)} rounds; range {min(ratios):.4f}-{max(ratios):.4f}")
PY
