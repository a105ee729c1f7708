#!/usr/bin/env bash
# Start `mini-deepinfer serve` on the tiny model, run the load generator against it with zero-overhead
# scheduling on and off, and leave the JSON results in OUTDIR.
#
#   benchmarks/serve_bench.sh DEVICE OUTDIR [extra serve flags...]
#   e.g. benchmarks/serve_bench.sh cpu /tmp/bench --max-num-seqs 32
#
# Load (override with env): NUM_PROMPTS=64 INPUT_LEN=128 OUTPUT_LEN=32 CONCURRENCY=16 RATE=inf
set -euo pipefail
device=${1:?device}; out=${2:?outdir}; shift 2
mkdir -p "$out"
PY=${PY:-python3}
port=${PORT:-8391}
for mode in zos no-zos; do
  flag=""; [ "$mode" = no-zos ] && flag="--no-zos"
  $PY -m deploy.cli --log-level WARNING serve --device "$device" --port "$port" $flag "$@" >"$out/server-$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || { echo "server died"; cat "$out/server-$mode.log"; exit 1; }
    sleep 0.5
  done
  $PY -m benchmarks.serve --base-url "http://127.0.0.1:$port" --num-prompts "${NUM_PROMPTS:-64}" \
      --random-input-len "${INPUT_LEN:-128}" --random-output-len "${OUTPUT_LEN:-32}" \
      --max-concurrency "${CONCURRENCY:-16}" --request-rate "${RATE:-inf}" --num-warmups 4 --label "$device-$mode" \
      --save-result --save-detailed --result-dir "$out" --result-filename "$device-$mode.json" \
      | tee "$out/$device-$mode.txt"
  kill $pid; wait $pid 2>/dev/null || true
done
