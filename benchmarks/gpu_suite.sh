#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in groups that fit one device call each.
# Usage: bash benchmarks/gpu_suite.sh OUTDIR GROUP...   (groups below)
#   pair    both GPUs, one item at a time: the demo on two GPUs, the push benchmark (update
#           channel and SGLang protocol), the two-GPU tests, context parallelism
#   single  two streams at once, one per GPU: the one-GPU tests and benchmarks, the largest shape
#           per memory option
#   memory  two streams at once: the memory options' cost and longest sequence
#   recheck two streams: the items the previous runs found defects in (per-layer state on the
#           device, the decode loop's seeded draw), the defaults on a 160k-token batch, timing
#   first   two streams: decode profiles and the compiled loop (GPU 0), 14B per-layer bf16 and
#           LoRA 32B (GPU 1)
#   third   Qwen3-1.7B cp=2 at 262k; then the decode step per kernel option and the loop with
#           the fastest (GPU 0) beside the 7B shape's longest sequence, per-layer bf16 (GPU 1)
#   fourth  the decode GPU tests (GPU 0) beside the demo (GPU 1); then the two-GPU tests
#   owed_a  two streams: decode step per option, the loop by default, decode tests (GPU 0);
#           the 7B shape's longest sequence with the bf16 options (GPU 1)
#   owed_b  the demo on two GPUs and on one, then the two-GPU tests
#   owed_c  the 7B shape at 262,144 tokens with cp=2 (the limit past 131,072)
#   owed_d  one GPU: the fp32 options' longest sequence, the per-layer step at 14B
#   s1      two streams: decode tests, step per option, the loop (GPU 0); the demo and the 7B
#           shape's longest sequence with per_layer_bf16 (GPU 1)
#   s2      two streams: decode tests, the loop, a profile (GPU 0); the demo and the longest
#           sequence of the other memory options (GPU 1)
#   s3      two streams: decode tests and the loop (GPU 0), the demo and bf16 at 131,072 (GPU 1);
#           then the two-GPU tests
#   s4      the 7B shape at 196,608 tokens with cp=2 (issue 17, owed)
#   s5      one GPU: the decode attention kernels, the decode tests, the loop with each attention
#   s6      one GPU: the decode tests, the loop at every shape, the demo, a profile
#   s7      both GPUs: the demo on two GPUs, then s4
#   s8      one GPU: GRPO from YAML on the 1.5B shape with its stage split (issue 22, owed), then
#           a profile of the decode step
#   s9      one GPU: the demo, then GRPO from YAML on the 1.5B shape with its stage split
#   s10     one GPU: the decode tests, then the 1.5B GRPO run again (seeded draws in the kernel)
#   s11     one GPU: the decode loop at every shape with seeded requests, a decode step profile
#   s12     one GPU: the decode tests and the decode step profile
#   long    both GPUs: the long cp cells alone (7B at 131k, Qwen3-1.7B at 262k)
#   decode  one GPU, in sequence: where a decode step's time goes, eager and compiled; the
#           compiled decode loop at 512 and 1,024 rows; the decode GPU tests
#   decode_opts  one GPU: the decode loop at 512 rows as it is, with flex attention, with
#           Liger's fused modules
#   large   one GPU: the 14B shape with the per-layer bf16 step, LoRA on the 32B shape
#   longest one GPU: the longest sequence of the 7B shape, default and per-layer bf16
#   rest    the push benchmark, then two streams: checkpoints, the memory options' cost, LoRA
#           on the full 7B shape, the longest sequence with the per-layer step
# Each item runs under its own timeout; its output is OUTDIR/<item>.txt; OUTDIR/items.txt lists
# each item's exit status and seconds. At the end everything but items.txt is packed into
# OUTDIR/results.tgz (a device call returns only a few files).
set -uo pipefail
out=${1:?OUTDIR}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

item() {  # item NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$out/items.txt"
}

pair() {
  item demo2 200 env LAYOUTS=two DEMO_TIMEOUT=190 bash benchmarks/gpu_demo.sh "$out/demo"
  item push 150 python benchmarks/push.py --pushes 6 --sglang
  item tests_pair 130 python -m pytest -q -x -p no:cacheprovider tests/e2e/test_cp_gpu.py \
    tests/e2e/test_weights_gpu.py
  item cp 200 torchrun --nproc-per-node 2 benchmarks/cp.py --out "$out/cp.jsonl" \
    --cells dp2:65536 cp2:65536 cp2:131072 dp2:131072
}

single_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item tests_checksum 60 python -m pytest -q -p no:cacheprovider tests/e2e/test_checksum_gpu.py
  item timing 150 python benchmarks/timing.py --out "$out/timing" --steps 3 --memory
  item rollout 130 python benchmarks/rollout.py --rows 512
  item tests_single 230 python -m pytest -q -p no:cacheprovider tests/e2e/test_oom_gpu.py \
    tests/e2e/test_memory_gpu.py tests/e2e/test_decode_gpu.py tests/e2e/test_ipc_gpu.py \
    tests/e2e/test_liger_gpu.py
}

single_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item mem_largest 340 python benchmarks/memory.py largest --shapes 7B 14B \
    --options default bf16 per_layer per_layer_bf16 --steps 1 --timeout 120
  item lora 200 torchrun --nproc-per-node 1 benchmarks/lora.py --layers 8 --steps 3
}

memory_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item checkpoint 220 python benchmarks/checkpoint.py --rounds 1 --dir /tmp/fsdpfn-ckpt-bench
}

memory_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item mem_cost 250 python benchmarks/memory.py cost --shape 1.5B --steps 2 --timeout 120
  item mem_longest 300 python benchmarks/memory.py longest --options default per_layer_bf16 \
    --steps 1 --seq 32768 --max-seq 262144 --timeout 140
}

recheck_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item rollout 120 python benchmarks/rollout.py --rows 512 --no-concurrent
  item rollout_fused 120 python benchmarks/rollout.py --rows 512 --no-concurrent --fused-kernels
  item rollout_flex 130 python benchmarks/rollout.py --rows 512 --no-concurrent \
    --decode-attention flex
  item decode_profile 80 python benchmarks/decode_profile.py --rows 512 --new 64
  item tests_decode 120 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
}

recheck_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item tests_memory 200 python -m pytest -q -p no:cacheprovider tests/e2e/test_memory_gpu.py
  item mem_largest 250 python benchmarks/memory.py largest --shapes 14B 32B \
    --options per_layer per_layer_bf16 --steps 1 --timeout 120
  item timing 100 python benchmarks/timing.py --out "$out/timing" --steps 3
}

rest_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item checkpoint 180 python benchmarks/checkpoint.py --rounds 1 --dir /tmp/fsdpfn-ckpt-bench
  item mem_cost 220 python benchmarks/memory.py cost --shape 1.5B --steps 2 --timeout 100
  item defaults 150 python benchmarks/defaults.py
}

rest_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item lora 200 torchrun --nproc-per-node 1 benchmarks/lora.py --steps 3 --ac
  item lora_large 200 torchrun --nproc-per-node 1 benchmarks/lora.py --model 32B --modes r16 \
    --steps 2 --ac
  item mem_longest 180 python benchmarks/memory.py longest --options per_layer_bf16 \
    --steps 1 --seq 32768 --max-seq 131072 --timeout 60
}

# one GPU, items in sequence (the one-GPU kind): what the last one-GPU runs left owed
decode() {
  item decode_profile 140 python benchmarks/decode_profile.py --rows 512 --new 64
  item decode_profile_compile 160 python benchmarks/decode_profile.py --rows 512 --new 64 \
    --decode-compile
  item rollout_compile 150 python benchmarks/rollout.py --rows 512 1024 --no-concurrent \
    --decode-compile
  item tests_decode 110 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
}

decode_opts() {
  item decode_profile_opts 150 python benchmarks/decode_profile.py --rows 512 --new 64 \
    --decode-attention flex --fused-kernels
  item rollout 130 python benchmarks/rollout.py --rows 512 --no-concurrent
  item rollout_flex 130 python benchmarks/rollout.py --rows 512 --no-concurrent \
    --decode-attention flex
  item rollout_fused 130 python benchmarks/rollout.py --rows 512 --no-concurrent --fused-kernels
}

large() {
  item mem_largest 300 python benchmarks/memory.py largest --shapes 14B \
    --options per_layer_bf16 --steps 1 --timeout 290
  item lora_large 250 torchrun --nproc-per-node 1 benchmarks/lora.py --model 32B --modes r16 \
    --steps 2 --ac
}

longest() {
  item mem_longest 580 python benchmarks/memory.py longest --options default per_layer_bf16 \
    --steps 1 --seq 32768 --max-seq 131072 --timeout 150
}

# two streams on the two-GPU kind: the decode profile (eager, compiled) and compiled loop on GPU 0,
# the largest shapes (14B per-layer bf16, LoRA 32B) on GPU 1
first_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item decode_profile 130 python benchmarks/decode_profile.py --rows 512 --new 64
  item decode_profile_compile 150 python benchmarks/decode_profile.py --rows 512 --new 64 \
    --decode-compile
  item rollout_compile 140 python benchmarks/rollout.py --rows 512 --no-concurrent \
    --decode-compile
  item tests_decode 100 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
}

first_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item mem_largest 290 python benchmarks/memory.py largest --shapes 14B \
    --options per_layer_bf16 --steps 1 --timeout 280
  item lora_large 230 torchrun --nproc-per-node 1 benchmarks/lora.py --model 32B --modes r16 \
    --steps 2 --ac
}

# the two-GPU kind: Qwen3-1.7B at 262k tokens on both GPUs, then two streams: the decode step per
# kernel option and the whole loop with the fastest (GPU 0), the 7B shape's longest sequence with
# the per-layer bf16 step (GPU 1)
third_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item decode_step 150 python benchmarks/decode_step.py
  local flags
  flags=$(grep '^best:' "$out/decode_step.txt" | cut -d: -f2)
  echo "rollout flags:$flags" >> "$out/items.txt"
  item rollout_best 170 python benchmarks/rollout.py --no-concurrent $flags
}

third_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item mem_longest 300 python benchmarks/memory.py longest --options per_layer_bf16 \
    --steps 1 --seq 32768 --max-seq 131072 --timeout 130
}

# the two-GPU kind: the two-GPU tests, then the decode GPU tests (GPU 0) beside the demo (GPU 1)
fourth_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item tests_decode 150 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
}

fourth_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item demo1 160 env LAYOUTS=one DEMO_GPU=1 DEMO_TIMEOUT=150 bash benchmarks/gpu_demo.sh "$out/demo"
}

# what the night's runs left owed (BENCHMARKS.md, 2026-11-30 night)
owed_a_gpu0() {  # the decode step after the fused q/k/v and rotary, the loop by default, tests
  export CUDA_VISIBLE_DEVICES=0
  item decode_step 200 python benchmarks/decode_step.py
  item rollout 250 python benchmarks/rollout.py --no-concurrent
  item tests_decode 150 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
}

owed_a_gpu1() {  # the 7B shape's longest sequence, bf16 options (trials name their stage)
  export CUDA_VISIBLE_DEVICES=1
  item mem_longest_bf16 590 python benchmarks/memory.py longest \
    --options per_layer_bf16 bf16 --steps 1 --seq 16384 --max-seq 131072 --timeout 150
}

owed_d() {  # one GPU: the fp32 options' longest sequence and the per-layer step's largest shape
  item mem_longest_fp32 330 python benchmarks/memory.py longest --options default per_layer \
    --steps 1 --seq 16384 --max-seq 65536 --timeout 110
  item mem_largest 250 python benchmarks/memory.py largest --shapes 14B --options per_layer \
    --steps 1 --timeout 240
}

# this session's groups: flash decode attention and the server's new defaults (GPU 0) beside the
# demo on one GPU and the 7B shape's longest sequences in one process per option (GPU 1)
s1_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item tests_decode 230 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
  item decode_step 130 python benchmarks/decode_step.py --options sdpa flash "fused, sdpa" \
    "fused, flash"
  item rollout 190 python benchmarks/rollout.py --no-concurrent
}

s1_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item demo1 170 env LAYOUTS=one DEMO_GPU=1 DEMO_TIMEOUT=160 bash benchmarks/gpu_demo.sh "$out/demo"
  item mem_longest_plbf16 380 python benchmarks/memory.py longest --options per_layer_bf16 \
    --steps 1 --seq 16384 --max-seq 131072 --timeout 370
}

# after s1: the one-pass draw (GPU 0: tests, the loop, a profile) beside the demo and the 7B
# shape's longest sequence for the other memory options (GPU 1)
s2_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item tests_decode 200 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
  item rollout 200 python benchmarks/rollout.py --no-concurrent
  item decode_profile 130 python benchmarks/decode_profile.py --rows 512 --new 64
}

s2_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item demo1 150 env LAYOUTS=one DEMO_GPU=1 DEMO_TIMEOUT=140 bash benchmarks/gpu_demo.sh "$out/demo"
  item mem_longest 395 python benchmarks/memory.py longest --options bf16 default per_layer \
    --steps 1 --seq 16384 --max-seq 131072 --timeout 130
}

# after s2: the chunked one-pass draw (GPU 0) beside the bf16 option at 131,072 tokens (GPU 1),
# then the two-GPU tests
s3_gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  item tests_decode 130 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
  item rollout 150 python benchmarks/rollout.py --no-concurrent --rows 512 1024
}

s3_gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  item demo1 140 env LAYOUTS=one DEMO_GPU=1 DEMO_TIMEOUT=130 bash benchmarks/gpu_demo.sh "$out/demo"
  item mem_longest_bf16 150 python benchmarks/memory.py longest --options bf16 --no-warmup \
    --steps 1 --seq 131072 --max-seq 131072 --timeout 145
}

# one GPU: the decode attention kernels alone, the decode GPU tests, the loop at 512 rows with
# the defaults and with the Triton attention, the network step per attention (issue 22)
s5() {
  item attn_bench 60 python benchmarks/decode_attention.py
  item tests_decode 200 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
  item rollout 120 python benchmarks/rollout.py --no-concurrent --rows 512
  item rollout_triton 120 python benchmarks/rollout.py --no-concurrent --rows 512 \
    --decode-attention triton
  item decode_step 90 python benchmarks/decode_step.py --rows 512 --options "fused, flash" \
    "fused, triton"
}

# one GPU, after s5 made the Triton attention the default: the decode tests, the loop at every
# shape, a profile of the step, the demo (issue 22)
s6() {
  item tests_decode 150 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
  item rollout 200 python benchmarks/rollout.py --no-concurrent
  item demo1 150 env LAYOUTS=one DEMO_TIMEOUT=140 bash benchmarks/gpu_demo.sh "$out/demo"
  item decode_profile 80 python benchmarks/decode_profile.py --rows 512 --new 64
}

grpo_1p5b() {  # GRPO from YAML on the 1.5B shape (model dir and data first), its stage split
  item grpo_prep 60 python benchmarks/grpo_1p5b.py --root /tmp/fsdpfn_1p5b
  item grpo_1p5b 280 python -m fsdpfn run examples/gpu/grpo_qwen2_1p5b.yaml steps=5
  item grpo_stages 30 python benchmarks/stages.py /tmp/runs/grpo_1p5b
}

long() {
  item cp131k 300 torchrun --nproc-per-node 2 benchmarks/cp.py --out "$out/cp.jsonl" \
    --cells cp2:131072
  item cp262k 250 torchrun --nproc-per-node 2 benchmarks/cp.py --out "$out/cp.jsonl" \
    --model qwen3-1.7B --cells cp2:262144
}

for group in "$@"; do
  case $group in
    pair) pair ;;
    single) single_gpu0 & single_gpu1 & wait ;;
    memory) memory_gpu0 & memory_gpu1 & wait ;;
    recheck) recheck_gpu0 & recheck_gpu1 & wait ;;
    first) first_gpu0 & first_gpu1 & wait ;;
    third) item cp262k 220 torchrun --nproc-per-node 2 benchmarks/cp.py --out "$out/cp.jsonl" \
             --model qwen3-1.7B --cells cp2:262144
           third_gpu0 & third_gpu1 & wait ;;
    fourth) fourth_gpu0 & fourth_gpu1 & wait
            item tests_pair 125 python -m pytest -q -p no:cacheprovider \
              tests/e2e/test_weights_gpu.py tests/e2e/test_cp_gpu.py ;;
    owed_a) owed_a_gpu0 & owed_a_gpu1 & wait ;;
    s1) s1_gpu0 & s1_gpu1 & wait ;;
    s2) s2_gpu0 & s2_gpu1 & wait ;;
    s3) s3_gpu0 & s3_gpu1 & wait
        item tests_pair 240 python -m pytest -q -p no:cacheprovider \
          tests/e2e/test_weights_gpu.py tests/e2e/test_cp_gpu.py ;;
    s5) s5 ;;
    s6) s6 ;;
    s8) grpo_1p5b
        item decode_profile 150 python benchmarks/decode_profile.py --rows 512 --new 64 ;;
    s9) item demo1 200 env LAYOUTS=one DEMO_TIMEOUT=190 bash benchmarks/gpu_demo.sh "$out/demo"
        grpo_1p5b ;;
    s10) item tests_decode 180 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
         grpo_1p5b ;;
    s11) item rollout_seeded 220 python benchmarks/rollout.py --no-concurrent --seeded
         item decode_profile 200 python benchmarks/decode_profile.py --rows 512 --new 64 ;;
    s12) item tests_decode 180 python -m pytest -q -p no:cacheprovider tests/e2e/test_decode_gpu.py
         item decode_profile 150 python benchmarks/decode_profile.py --rows 512 --new 64 ;;
    s7) item demo2 200 env LAYOUTS=two DEMO_TIMEOUT=190 bash benchmarks/gpu_demo.sh "$out/demo"
        item cp7b_196k 340 torchrun --nproc-per-node 2 benchmarks/cp.py \
          --out "$out/cp.jsonl" --cells cp2:196608 ;;
    s4) item cp7b_196k 330 torchrun --nproc-per-node 2 benchmarks/cp.py \
          --out "$out/cp.jsonl" --cells cp2:196608 ;;
    owed_b) item demo 330 env DEMO_TIMEOUT=160 bash benchmarks/gpu_demo.sh "$out/demo"
            item tests_pair 240 python -m pytest -q -p no:cacheprovider \
              tests/e2e/test_weights_gpu.py tests/e2e/test_cp_gpu.py ;;
    owed_c) item cp7b_262k 590 torchrun --nproc-per-node 2 benchmarks/cp.py \
              --out "$out/cp.jsonl" --cells cp2:262144 ;;
    owed_d) owed_d ;;
    long) long ;;
    decode) decode ;;
    decode_opts) decode_opts ;;
    large) large ;;
    longest) longest ;;
    rest) item push 150 python benchmarks/push.py --quick --pushes 6 --sglang
          rest_gpu0 & rest_gpu1 & wait ;;
    *) echo "unknown group $group"; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1
git rev-parse --short HEAD > "$out/commit.txt" 2>/dev/null
cp "$out/items.txt" /tmp/fsdpfn_items.txt 2>/dev/null
tar -C "$out" -czf /tmp/fsdpfn_results.tgz . && find "$out" -mindepth 1 -delete \
  && mv /tmp/fsdpfn_results.tgz "$out/results.tgz" && cp /tmp/fsdpfn_items.txt "$out/items.txt"
