#!/usr/bin/env bash
# One device call: the packing benchmark (bench/packing.py) on one GPU, 8B then 1B-class.
# Needs .whl_engine (../shared/tools/offline-wheels.sh, WHL_DIR=.whl_engine) carried along, as
# bench/train_step_call.sh. Rows go to $OUT/results.jsonl (copy them into bench/results.jsonl).
set -u
export PYTHONUNBUFFERED=1 CALL_ID=${CALL_ID:-$(date +%s)}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_engine/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one GPU: every job packs onto it
timeout 290 python3 bench/packing.py --model llama-3.1-8b --jobs ${JOBS:-4} --steps ${STEPS_8B:-60} --timeout 270 | grep RESULT
timeout 290 python3 bench/packing.py --model llama-3.2-1b --jobs ${JOBS:-4} --steps ${STEPS_1B:-150} --timeout 270 | grep RESULT
tail -5 $OUT/packing_*.log
