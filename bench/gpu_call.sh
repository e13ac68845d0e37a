#!/usr/bin/env bash
# One device call, stage by stage (STAGES, default "tests nf4 gen grpo train"): GPU tests, the NF4
# matmul bench + tile sweep, the decode profile, our GRPO / train figures, and the Unsloth anchors
# (make, u_train, u_grpo, ...; they need .anchors). Every stage has a timeout inside CALL_LIMIT_S
# (default 540 s). Carry .whl (pytest), .whl_engine, .whl_grpo (../shared/tools/offline-wheels.sh)
# and .anchors (a copy of ../shared/bench). Logs under $OUT; RESULT lines are the rows.
#   WHETSTONE_COMMIT=$(git rev-parse --short=12 HEAD) CALL_ID=... bash bench/gpu_call.sh
set -u
LIMIT=${CALL_LIMIT_S:-540}
export PYTHONUNBUFFERED=1 CALL_ID=${CALL_ID:-gpu-$(date +%s)} OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
tmo() { local l=$((LIMIT - SECONDS - 10)); if ((l < $1)); then echo $((l > 0 ? l : 1)); else echo "$1"; fi; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl_engine/*.whl .whl_grpo/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
stage() {  # NAME TIMEOUT CMD...
  local name=$1 t; t=$(tmo "$2"); shift 2
  echo "=== $name (timeout ${t}s, t=${SECONDS}s)"
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  echo "rc=$rc"; grep -E "^(RESULT|STEP|GEN|engine:|generation:|## |\| )|passed|failed|error" "$OUT/$name.txt" | tail -${TAIL:-40}
}
for s in ${STAGES:-tests nf4 gen grpo train}; do
  case $s in
    tests) TAIL=30 stage gpu_tests 200 python3 -m pytest -q --import-mode=append -p no:cacheprovider \
             tests/gpu/test_decode_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_kernels_gpu.py \
             tests/gpu/test_attention_gpu.py tests/gpu/test_launch_gpu.py ;;
    etests) TAIL=30 stage gpu_engine_tests 200 python3 -m pytest -q --import-mode=append -p no:cacheprovider \
              tests/gpu/test_engine_gpu.py tests/gpu/test_attention_gpu.py tests/gpu/test_grpo_gpu.py ;;
    dtests) TAIL=30 stage gpu_decode_tests 200 python3 -m pytest -q --import-mode=append -p no:cacheprovider \
              tests/gpu/test_decode_gpu.py tests/gpu/test_grpo_gpu.py \
              tests/gpu/test_kernels_gpu.py -k "nf4 or cross_entropy" ;;
    ktests) TAIL=30 stage gpu_kernel_tests 200 python3 -m pytest -q --import-mode=append -p no:cacheprovider \
              tests/gpu/test_launch_gpu.py tests/gpu/test_kernels_gpu.py -k "rms or glu or nf4 or rope or launch" ;;
    nf4s) TAIL=40 stage nf4_sweep 150 python3 bench/nf4_dequant_sweep.py ;;
    lprobe) TAIL=20 stage launch_probe 90 python3 bench/launch_probe.py ;;
    csplit) TAIL=45 stage cpu_split 90 python3 bench/cpu_split.py qlora 2048 2 ;;
    csplit_nooff) TAIL=45 stage cpu_split_nooff 90 python3 bench/cpu_split.py qlora 2048 2 --no-offload ;;
    csplit_budget) TAIL=45 stage cpu_split_budget 90 python3 bench/cpu_split.py qlora 2048 2 --budget 40 ;;
    probe) TAIL=30 stage probe 90 python3 bench/probe_attention.py ;;
    ptrain) TAIL=90 stage prof_train 120 python3 bench/profile_step.py train qlora 2048 2 ;;
    pbudget) TAIL=60 BUDGET=40 stage prof_budget 120 python3 bench/profile_step.py train qlora 2048 2 ;;
    plora) TAIL=60 stage prof_lora 120 python3 bench/profile_step.py train lora 2048 2 ;;
    p16k) TAIL=60 stage prof_16k 150 python3 bench/profile_step.py train qlora 16384 1 ;;
    nf4) stage nf4_bench 200 python3 bench/nf4_matmul_bench.py --sweep ;;
    gen) TAIL=20 stage gen_profile 120 python3 bench/profile_step.py gen qlora 256 8 64 ;;
    grpo) stage grpo_256 170 python3 bench/grpo_step.py --prompt-len 256 --completion-len 256 \
            --num-generations 8 --steps 4 ;;
    grpo16) stage grpo_256x16 170 python3 bench/grpo_step.py --prompt-len 256 --completion-len 256 \
              --num-generations 8 --prompts-per-step 2 --steps 4 ;;
    grpo1k) stage grpo_1024 200 python3 bench/grpo_step.py --prompt-len 1024 --completion-len 1024 \
              --num-generations 8 --steps 3 ;;
    train) stage train_2048 120 python3 bench/train_step.py qlora 2048 2 8 ;;
    train_nooff) stage train_2048_nooff 100 python3 bench/train_step.py qlora 2048 2 8 --no-offload ;;
    train_tl) WHETSTONE_FAST_LAUNCH=0 stage train_2048_triton_launch 120 python3 bench/train_step.py qlora 2048 2 8 ;;
    lora_tl) WHETSTONE_FAST_LAUNCH=0 stage train_lora_triton_launch 120 python3 bench/train_step.py lora 2048 2 8 ;;
    traingc) BENCH_GC_FREEZE=1 stage train_2048_gc 120 python3 bench/train_step.py qlora 2048 2 8 ;;
    train_o) WHETSTONE_ATTN_STASH=o stage train_2048_stash_o 100 python3 bench/train_step.py qlora 2048 2 8 ;;
    train_off) WHETSTONE_ATTN_STASH=off stage train_2048_stash_off 100 python3 bench/train_step.py qlora 2048 2 8 ;;
    train16k) stage train_16k 120 python3 bench/train_step.py qlora 16384 1 6 ;;
    trainbudget) stage train_budget 120 python3 bench/train_step.py qlora 2048 2 8 --budget 40 ;;
    lora) stage train_lora 120 python3 bench/train_step.py lora 2048 2 8 ;;
    # anchors (../shared/bench copied to .anchors, carried): the random 8B model once, then Unsloth
    make) stage anchors_make 150 python3 .anchors/anchors.py make ;;
    u_train) stage unsloth_train 150 python3 .anchors/anchors.py run unsloth_qlora 2048 2 8 ;;
    u_train16k) stage unsloth_train16k 150 python3 .anchors/anchors.py run unsloth_qlora 16384 1 6 ;;
    u_lora) stage unsloth_lora 150 python3 .anchors/anchors.py run unsloth_lora 2048 2 8 ;;
    u_grpo) stage unsloth_grpo 200 python3 .anchors/grpo_anchor.py unsloth_qlora 256 256 8 4 ;;
    u_grpo1k) stage unsloth_grpo1k 300 python3 .anchors/grpo_anchor.py unsloth_qlora 1024 1024 8 3 ;;
  esac
done
echo "done t=${SECONDS}s"
