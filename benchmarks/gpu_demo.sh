#!/usr/bin/env bash
# The embedded demo on a GPU host: trainer on GPU 0 and server on GPU 1 (NCCL push), then both
# on GPU 0 (push by disk); per-stage seconds of each. LAYOUTS="two one" (default) or "one".
# Usage: bash benchmarks/gpu_demo.sh OUTDIR [overrides]
set -uo pipefail
out=${1:?OUTDIR}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
for layout in ${LAYOUTS:-two one}; do
  dir=/tmp/runs/demo_$layout
  if [ $layout = one ]; then vis=${DEMO_GPU:-0}; else vis=0,1; fi
  start=$(date +%s)
  CUDA_VISIBLE_DEVICES=$vis timeout ${DEMO_TIMEOUT:-280} python3 -m fsdpfn demo run_dir=$dir "$@" --overwrite 2>&1 \
    | grep -v -E "^(warm-up|grpo) .*\|" | tail -25
  echo "[$layout] exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
  cp $dir/metrics.jsonl "$out/metrics_$layout.jsonl" 2>/dev/null
  cp $dir/rollout.log "$out/rollout_$layout.log" 2>/dev/null
  cp $dir/summary.json "$out/summary_$layout.json" 2>/dev/null
done
python3 benchmarks/stages.py $(for l in ${LAYOUTS:-two one}; do echo /tmp/runs/demo_$l; done)
