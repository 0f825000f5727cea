#!/usr/bin/env bash
# Scaling runs for a host with 4 or 8 GPUs (one node). Prints one table per run; copy the rows
# into BENCHMARKS.md with the command that produced them.
#
#   bash benchmarks/scaling.sh 8        # on an 8-GPU machine
#   bash benchmarks/scaling.sh 2        # dry run of the same commands on 2 GPUs
#
# 1. weak scaling of ppo_step, Qwen2-1.5B shape: 64 sequences per GPU at dp = 1, 2, 4, 8
#    (tokens/s per GPU and efficiency against dp=1)
# 2. the 7B shape at dp=N (dp=N/2 x tp=2 where N >= 4): tokens/s per GPU, MFU, peak memory,
#    and log-probs compared across the layouts by the tp section
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-8}
opts="--rate ${RATE:-785}"
for dp in 1 2 4 8; do
  [ "$dp" -le "$n" ] || break
  if [ "$dp" -eq 1 ]; then
    python benchmarks/run.py --only ppo_variants $opts
  else
    torchrun --nproc-per-node "$dp" benchmarks/run.py --only ppo $opts
  fi
done
torchrun --nproc-per-node 2 benchmarks/run.py --only tp $opts
if [ "$n" -ge 4 ]; then
  torchrun --nproc-per-node "$n" benchmarks/run.py --only ppo --model 7B --budget 8192 $opts
fi
