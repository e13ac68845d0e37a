#!/usr/bin/env bash
# One device call: engine GPU tests, then bench/train_step.py beside the Unsloth anchor, same machine.
# --import-mode=append: with pytest's default prepend mode tests/kernels (a package) shadows kernels/.
# Needs .whl_engine (../shared/tools/offline-wheels.sh, WHL_DIR=.whl_engine) and .anchors (a copy
# of ../shared/bench) carried along. Results under $OUT (train_step.jsonl, results.jsonl, logs).
set -u
export PYTHONUNBUFFERED=1 CALL_ID=${CALL_ID:-$(date +%s)}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_engine/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch,triton,transformers,peft,bitsandbytes; print("torch",torch.__version__,"triton",triton.__version__,"tf",transformers.__version__,"peft",peft.__version__,"bnb",bitsandbytes.__version__)'
timeout 120 python3 -m pytest -q -x --import-mode=append tests/gpu/test_engine_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
w() { echo "=== whetstone $*"; timeout 150 python3 bench/train_step.py "$@" > "$OUT/log_w_$1_$2_${5:-x}${6:-}.txt" 2>&1; rc=$?; grep RESULT "$OUT/log_w_$1_$2_${5:-x}${6:-}.txt" || { echo "rc=$rc"; tail -20 "$OUT/log_w_$1_$2_${5:-x}${6:-}.txt"; }; }
w qlora 2048 2 6
if [ -n "${ANCHOR:-1}" ]; then
  python3 .anchors/anchors.py make 2>&1 | tail -2
  echo "=== anchor unsloth_qlora 2048 2 8"
  timeout 200 python3 .anchors/anchors.py run unsloth_qlora 2048 2 8 > $OUT/log_unsloth.txt 2>&1; grep RESULT $OUT/log_unsloth.txt || tail -20 $OUT/log_unsloth.txt
fi
w qlora 2048 2 6 --budget 40
w qlora 16384 1 5
w lora 2048 2 6
