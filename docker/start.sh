#!/usr/bin/env bash
# Start the studio: one worker per visible NVIDIA GPU (or one CPU worker), then the web process.
# Ctrl-C / SIGTERM stops everything; workers hand their running job back to the queue.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${WHETSTONE_PYTHON:-.venv/bin/python}
[ -x "$BIN" ] || BIN=python3
pids=()
stop() {
  trap - INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  wait
  exit 0
}
trap stop INT TERM
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
"$BIN" -m app.store.migrate
if [ "${gpus:-0}" -gt 0 ]; then
  for ((i = 0; i < gpus; i++)); do
    CUDA_VISIBLE_DEVICES=$i "$BIN" -m worker --worker-id "$(hostname)-gpu$i" &
    pids+=($!)
  done
else
  CUDA_VISIBLE_DEVICES= "$BIN" -m worker --worker-id "$(hostname)-cpu" &
  pids+=($!)
fi
"$BIN" -m app.web.main &
pids+=($!)
echo "Whetstone: http://${WHETSTONE_HOST:-127.0.0.1}:${WHETSTONE_PORT:-8000}  (workers: $((${gpus:-0} > 0 ? gpus : 1)))"
wait -n
stop
