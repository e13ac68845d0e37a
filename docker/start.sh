#!/usr/bin/env bash
# Start the studio: one worker per visible NVIDIA GPU (or one CPU worker), then the web process.
# A worker that exits (crash, OOM kill, SIGTERM to it alone) is restarted after a pause, so the
# studio stays up; its running job was handed back to the queue (or is reaped when its lease
# expires) and continues from the last checkpoint. Ctrl-C / SIGTERM to this script stops all.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${WHETSTONE_PYTHON:-.venv/bin/python}
[ -x "$BIN" ] || BIN=python3
RESTART_PAUSE=${WHETSTONE_WORKER_RESTART_SECONDS:-5}
pids=()

supervise_worker() {  # $1 = CUDA_VISIBLE_DEVICES value, $2 = worker id
  local child=0
  trap 'kill -TERM $child 2>/dev/null; wait $child 2>/dev/null; exit 0' TERM INT
  while true; do
    CUDA_VISIBLE_DEVICES=$1 "$BIN" -m worker --worker-id "$2" &
    child=$!
    wait $child
    echo "start.sh: worker $2 exited (status $?); restarting in ${RESTART_PAUSE}s" >&2
    sleep "$RESTART_PAUSE" & wait $!
  done
}

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
"$BIN" -m app.store.migrate || exit 1
if [ "${gpus:-0}" -gt 0 ]; then
  for ((i = 0; i < gpus; i++)); do
    supervise_worker "$i" "$(hostname)-gpu$i" &
    pids+=($!)
  done
else
  supervise_worker "" "$(hostname)-cpu" &
  pids+=($!)
fi
"$BIN" -m app.web.main &
web=$!
pids+=($web)
echo "Whetstone: http://${WHETSTONE_HOST:-127.0.0.1}:${WHETSTONE_PORT:-8000}  (workers: $((${gpus:-0} > 0 ? gpus : 1)))"
wait $web
echo "start.sh: the web process exited; stopping the workers" >&2
stop
