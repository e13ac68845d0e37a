#!/usr/bin/env bash
# One device call for issue 17 parts 1-2: the worker's real SFT job on real rows (bench/sft_job.py),
# Unsloth's SFTTrainer on the same token rows (bench/sft_unsloth.py), the longest trainable context
# (bench/max_context.py). Carry .whl_studio (web stack, trl, datasets 4.8.5, bitsandbytes), .whl_bench
# (unsloth, unsloth_zoo, torchao, cut_cross_entropy, tyro, ..., and tok-llama2/: the llama2 tokenizer
# as tokenizer.json) and .seed (sft/). Two sites: /tmp/site (.whl_studio: whetstone stages) and
# /tmp/site_u (.whl_studio + .whl_bench: unsloth stages; Unsloth refuses only datasets 4.4-4.5).
# Inputs (16 GB random model, rows, token rows, the studio data dir) go to $SFT17_DIR (default
# $PWD/.sft17, git-ignored): a warm machine keeps them between calls.
#   STAGES="prep w2048 u2048" WHETSTONE_COMMIT=$(git rev-parse --short=12 HEAD) CALL_ID=... \
#     bash bench/sft17_call.sh
# Stages: prep (model + rows + token rows), w2048 w4096 (sft_job, W_MODES), b2048 b4096 (the bare
# engine step on the job's batches, B_MODES, one load), u2048 u4096
# (sft_unsloth, one process per U_MODES mode), ctx_w ctx_u (max_context, CTX_CAP s of probes).
set -u
LIMIT=${CALL_LIMIT_S:-585}
export PYTHONUNBUFFERED=1 CALL_ID=${CALL_ID:-s17-$(date +%s)} OUT=${OUT:-/tmp/s17-out}
export SFT17_DIR=${SFT17_DIR:-$PWD/.sft17} WHETSTONE_SEED_DIR=$PWD/.seed HF_HUB_OFFLINE=1
ROWS=${ROWS:-1000}  # rows of the combined file (0: all 1,812)
PY=${PY:-python3}
# TINY=1: the CPU check of this script (tiny model, 40 rows, LoRA on the CPU, Unsloth --dry, fake
# max_context); no wheels installed (PY=.venv/bin/python)
T=(); TU=(); TC=(); [ -n "${TINY:-}" ] && { T=(--tiny); TU=(--tiny --dry); TC=(--fake); ROWS=${TINY_ROWS:-40}; }
mkdir -p "$OUT" "$SFT17_DIR"
capfor() {  # CAP LOAD: the probes' time cap that still fits the call (>= 30 s)
  local t; t=$(tmo $(($1 + $2))); echo $((t - $2 > 30 ? t - $2 : 30)); }
tmo() { local l=$((LIMIT - SECONDS - 5)); if ((l < $1)); then echo $((l > 0 ? l : 1)); else echo "$1"; fi; }
site() {  # install the wheel set of /tmp/site (studio) or /tmp/site_u (unsloth) once
  [ -n "${TINY:-}" ] && return
  if [ "$1" = u ]; then
    [ -f /tmp/site_u/.done ] && return
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_u \
      .whl_studio/*.whl .whl_bench/*.whl >/dev/null 2>&1 && touch /tmp/site_u/.done || echo "unsloth wheel install failed"
  else
    [ -f /tmp/site/.done ] && return
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl_studio/*.whl >/dev/null 2>&1 && touch /tmp/site/.done || echo "wheel install failed"
  fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
free -g | head -2; df -h "$SFT17_DIR" | tail -1
stage() {  # NAME TIMEOUT SITE(s|u) CMD...
  local name=$1 t s=$3; t=$(tmo "$2"); shift 3
  site "$s"
  local pp=/tmp/site:$PWD; [ "$s" = u ] && pp=/tmp/site_u:$PWD
  echo "=== $name (timeout ${t}s, t=${SECONDS}s)"
  timeout "$t" env PYTHONPATH=$pp "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  echo "rc=$rc t=${SECONDS}s"
  grep -E "^RESULT|^LENGTHS|^PROBE|^WARMUP|ready in|Turning padding|Error|error" "$OUT/$name.txt" | cut -c1-${CUT:-1500} | tail -${TAIL:-14}
}
versions() {
  PYTHONPATH=$1:$PWD $PY -c 'import torch,triton,transformers,peft,trl,datasets; print("torch",torch.__version__,"triton",triton.__version__,"tf",transformers.__version__,"peft",peft.__version__,"trl",trl.__version__,"datasets",datasets.__version__)' 2>&1 | tail -1
}
for s in ${STAGES:-prep w2048 u2048}; do
  case $s in
    prep) site s; versions /tmp/site
          stage prep ${T_PREP:-150} s $PY bench/sft17_data.py prep --seqs ${SEQS:-2048,4096} --limit $ROWS "${T[@]}" ;;
    w2048|w4096) stage sft_job_${s#w} ${T_W:-330} s $PY bench/sft_job.py --seq ${s#w} --limit $ROWS "${T[@]}" \
           --modes ${W_MODES:-default,packing,padding_free} --bs ${BS:-8} ${PACK_BS:+--packing-bs $PACK_BS} \
           --max-steps "${MAX_STEPS:-}" --timeout ${RUN_WAIT:-240} ;;
    b2048|b4096) stage sft_bare_${s#b} ${T_B:-200} s $PY bench/sft_job.py --bare --seq ${s#b} --limit $ROWS \
           "${T[@]}" --modes ${B_MODES:-packing,padding_free} --bs ${BS:-8} ${PACK_BS:+--packing-bs $PACK_BS} \
           ${BARE_BUDGET:+--bare-budget $BARE_BUDGET} ;;
    u2048|u4096) site u; versions /tmp/site_u
           for m in ${U_MODES:-packing padding_free}; do
             stage sft_unsloth_${s#u}_$m ${T_U:-150} u $PY bench/sft_unsloth.py --seq ${s#u} --mode $m "${TU[@]}" \
               --limit $ROWS --bs ${BS:-8} ${PACK_BS:+--packing-bs $PACK_BS}
           done ;;
    ctx_w) c=$(capfor ${CTX_CAP:-200} 120); CUT=4000 stage max_context_whetstone $((c + 120)) s \
             $PY bench/max_context.py --impl whetstone "${TC[@]}" --time-cap $c ;;
    ctx_u) c=$(capfor ${CTX_CAP:-200} 150); CUT=4000 stage max_context_unsloth $((c + 150)) u \
             $PY bench/max_context.py --impl unsloth "${TC[@]}" --time-cap $c ;;
  esac
done
tail -c 2500 $OUT/sft_job_supervisor_*.log 2>/dev/null | grep -v "worker.progress" | tail -6
echo "done t=${SECONDS}s"
