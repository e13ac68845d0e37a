#!/usr/bin/env bash
# Start the studio: one worker supervisor that owns every visible NVIDIA GPU (python -m worker
# --supervise: admits jobs by estimated memory, several per GPU, each in its own process; a CPU
# lane for exports, imports and validation; the CPU alone when there is no GPU), then the web.
# Each process is supervised: one that exits (crash, OOM kill, SIGTERM to it alone) is restarted
# after a pause that doubles while it keeps dying young (WHETSTONE_WORKER_RESTART_SECONDS /
# WHETSTONE_WEB_RESTART_SECONDS, up to 60 s; back to the first pause after 60 s of uptime), so
# the studio stays up. A worker's running job was handed back to the queue (or is reaped when
# its lease expires) and continues from the last complete checkpoint; a web crash stops nothing
# else. Ctrl-C / SIGTERM to this script stops everything and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${WHETSTONE_PYTHON:-.venv/bin/python}
[ -x "$BIN" ] || BIN=python3
WORKER_PAUSE=${WHETSTONE_WORKER_RESTART_SECONDS:-5}
WEB_PAUSE=${WHETSTONE_WEB_RESTART_SECONDS:-2}
MAX_PAUSE=60
pids=()

supervise() {  # $1 = name, $2 = first pause (s), then the command; restarts it with backoff
  local name=$1 first=$2 child=0 pause=$2 started status
  shift 2
  trap 'kill -TERM $child 2>/dev/null; wait $child 2>/dev/null; exit 0' TERM INT
  while true; do
    started=$SECONDS
    "$@" &
    child=$!
    wait $child
    status=$?
    if ((SECONDS - started >= 60)); then pause=$first; fi
    echo "start.sh: $name exited (status $status); restarting in ${pause}s" >&2
    sleep "$pause" & wait $!
    pause=$((pause * 2 > MAX_PAUSE ? MAX_PAUSE : pause * 2))
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
supervise "worker supervisor" "$WORKER_PAUSE" \
  "$BIN" -m worker --supervise --worker-id "$(hostname)" &
pids+=($!)
supervise web "$WEB_PAUSE" "$BIN" -m app.web.main &
pids+=($!)
echo "Whetstone: http://${WHETSTONE_HOST:-127.0.0.1}:${WHETSTONE_PORT:-8000}  (GPUs: ${gpus:-0})"
while true; do wait; sleep 1; done  # only a signal (-> stop) ends this script
