#!/usr/bin/env bash
# One device call (issue 15): the studio's real job path on the GPU (bench/studio_gpu_check.py:
# web + `python -m worker --supervise`, a QLoRA and a LoRA run of stories260K over HTTP), then
# the packing benchmark (bench/packing.py: 4 jobs on one GPU vs one alone, 8B then 1B-class; its
# rows carry the estimator check), then optionally the GPU tests (STAGES). Carry .whl_studio
# (web deps, trl, datasets, bitsandbytes: ../shared/tools/offline-wheels.sh) and .seed (a copy of
# ../shared/data/models/stories260K under models/, sft/ and tokenizers/).
#   WHETSTONE_COMMIT=$(git rev-parse --short=12 HEAD) CALL_ID=... bash bench/studio_packing_call.sh
set -u
LIMIT=${CALL_LIMIT_S:-585}
export PYTHONUNBUFFERED=1 CALL_ID=${CALL_ID:-sp-$(date +%s)} OUT=${OUT:-/tmp/sp-out}
mkdir -p "$OUT"
tmo() { local l=$((LIMIT - SECONDS - 5)); if ((l < $1)); then echo $((l > 0 ? l : 1)); else echo "$1"; fi; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl_studio/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD WHETSTONE_SEED_DIR=$PWD/.seed
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch,triton,transformers,peft,bitsandbytes,trl,datasets,fastapi,sqlmodel,pyarrow,numpy; print("torch",torch.__version__,"triton",triton.__version__,"tf",transformers.__version__,"peft",peft.__version__,"bnb",bitsandbytes.__version__,"trl",trl.__version__,"datasets",datasets.__version__,"pyarrow",pyarrow.__version__,"numpy",numpy.__version__)'
stage() {  # NAME TIMEOUT CMD...
  local name=$1 t; t=$(tmo "$2"); shift 2
  echo "=== $name (timeout ${t}s, t=${SECONDS}s)"
  timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  echo "rc=$rc t=${SECONDS}s"; grep -E "^RESULT|passed|failed|Error" "$OUT/$name.txt" | cut -c1-${CUT:-2500} | tail -${TAIL:-12}
}
for s in ${STAGES:-studio p8b p1b}; do
  case $s in
    studio) stage studio ${T_STUDIO:-230} python3 bench/studio_gpu_check.py --steps 40 --timeout ${RUN_WAIT:-180} --configs ${CONFIGS:-qlora,lora} ;;
    p8b) stage packing_8b ${T_8B:-220} env CUDA_VISIBLE_DEVICES=0 python3 bench/packing.py --model llama-3.1-8b \
           --jobs 4 --steps ${STEPS_8B:-40} --timeout ${PHASE_8B:-100} --warmup-steps ${WARM_8B:-0} ;;
    p1b) stage packing_1b 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/packing.py --model llama-3.2-1b \
           --jobs 4 --steps ${STEPS_1B:-100} --timeout 65 ;;
    tests) TAIL=30 stage gpu_tests 230 python3 -m pytest -q --import-mode=append -p no:cacheprovider \
             ${GPU_TESTS:-tests/gpu/test_decode_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_kernels_gpu.py \
             tests/gpu/test_attention_gpu.py tests/gpu/test_launch_gpu.py} ;;
  esac
done
tail -c 3000 $OUT/studio_supervisor.log 2>/dev/null | grep -v "worker.progress" | tail -8
echo "done t=${SECONDS}s"
