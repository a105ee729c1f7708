#!/usr/bin/env bash
# The GPU figures at the top of docs/benchmarks.md, on the GPU this runs on: the engine's decode step
# (8 real-width layers, 384 experts, 1K context), a layer's nine FP8 projections, the FP4 experts and the
# floor of six dependent reads. Each part writes its log (and JSON where the script has one) to OUTDIR.
#
#   benchmarks/figures_of_record.sh OUTDIR [PART...]
#   PART: engine (batch 1, 8, 64), engine256 (batch 256, a process of its own: its caches leave no
#         room for a second engine), layer, experts, chain; default: all of them, in that order;
#         issue7 (not in the default): the config of issue 7's before-table, 6 real-width layers and 16
#         experts, at batch 1, 8 and 32
#
# On one H100 (36db30a) the default parts took 5.2 minutes including the kernels' first compile
# (engine, layer, experts and chain 239 s; engine256 72 s), and issue7 48 s more. Each run measures its own bandwidth and tensor-core rate and
# states every figure against the limits they give.
set -euo pipefail
out=${1:?outdir}; shift
parts=${*:-engine engine256 layer experts chain}
mkdir -p "$out"
PY=${PY:-python3}
run() {  # run NAME command...: the command's output in OUTDIR/NAME.log, and its last lines here
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1 || { echo "$name failed (exit $?); see $out/$name.log"; return 1; }
  tail -n 12 "$out/$name.log"
}
for part in $parts; do
  case $part in
    engine)    run engine $PY benchmarks/decode.py --preset v41-flash-L8 --kernels triton --batch 1,8,64 \
                   --context 1024 --json "$out/engine.json" ;;
    engine256) run engine256 $PY benchmarks/decode.py --preset v41-flash-L8 --kernels triton --batch 256 \
                   --context 1024 --json "$out/engine256.json" ;;
    layer)     run layer $PY benchmarks/kernels.py --kernels attn,indexer,shared --no-reference --quick \
                   --m 1,2,3,8,16,64,128,256 --json "$out/layer.json" ;;
    experts)   run experts $PY benchmarks/kernels.py --kernels moe --no-graph --no-reference --quick \
                   --m 1,8,64,256 --json "$out/experts.json" ;;
    chain)     run chain $PY -m benchmarks.read_chain ;;
    issue7)    run issue7 $PY benchmarks/decode.py --preset v41-flash-L8 --kernels triton --batch 1,8,32 \
                   --hf-overrides '{"num_hidden_layers": 6, "n_routed_experts": 16}' --json "$out/issue7.json" ;;
    *)         echo "unknown part $part (engine, engine256, layer, experts, chain, issue7)"; exit 2 ;;
  esac
done
