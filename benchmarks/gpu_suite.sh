#!/usr/bin/env bash
# Every GPU check and benchmark of the project, as a few named suites; each item prints its table.
# Usage: bash benchmarks/gpu_suite.sh OUTDIR SUITE...
#   check   every GPU test (but tests/e2e/test_lora_gpu.py, whose cold compile runs in `lora`)
#           and the demo on the GPUs at hand (one GPU: under 10 minutes); the suite to run after
#           any change to the main job's path
#   main    the main job from YAML on real shapes, each with its stage split: Qwen2-1.5B
#           (examples/gpu/grpo_qwen2_1p5b.yaml), Llama-3.2-1B on the defaults with 1,024-token
#           answers (grpo_llama_1b.yaml), Qwen2-7B with the per-layer step (grpo_qwen2_7b.yaml);
#           main_llama1b: the Llama-3.2-1B job alone (under 6 minutes)
#   decode  the server's decode loop at 512 and 1,024 rows and where a step's time goes (by
#           kernel category, the attention kernel at random lengths and at the loop's equal
#           ones, each projection's matmul per backend and against Triton tilings, the network
#           step with and without the fused add and norm, the projections and the KV cache
#           in FP8, the server on a float8 KV cache), and the /generate answer's cost outside the
#           steps, plain against packed
#   train   the training step's MFU against a naive step on a lognormal RL batch of two shapes
#           (with and without compile), the stage split, the defaults on a long batch
#   push    weight push (update channel and SGLang's protocol need two GPUs), checksum speed
#   cp      context parallelism at long lengths (two GPUs), and one 524,288-token row of the
#           7B shape with cp=2
#   memory  the memory options' cost, the largest shape and the longest row per option, and the
#           build time of the 7B and 14B shapes from random init and from safetensors
#   lora    compiled LoRA against eager LoRA (tests/e2e/test_lora_gpu.py), LoRA on the 7B shape
#           (with and without compile) and the 32B shape
# Items that need two GPUs are skipped, with a line in items.txt, on one.
# Each item runs under its own timeout; its output is OUTDIR/<item>.txt; OUTDIR/items.txt lists
# each item's exit status and seconds. At the end everything but items.txt is packed into
# OUTDIR/results.tgz (a device call returns only a few files).
set -uo pipefail
out=${1:?OUTDIR}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

item() {  # item NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a "$out/items.txt"
}

pair_item() {  # pair_item NAME SECONDS COMMAND...: only with two GPUs
  if [ "$gpus" -ge 2 ]; then item "$@"; else echo "$1 skipped: needs 2 GPUs, $gpus here" \
    | tee -a "$out/items.txt"; fi
}

# the GPU tests' temporary directories (models of up to 1.5B, 12 GB after `check`) would leave
# too little disk for the 7B run's checkpoint: a passed test's are not kept
pytest_gpu=(python3 -m pytest -q -p no:cacheprovider -o tmp_path_retention_policy=failed)

check() {
  item tests_gpu 480 "${pytest_gpu[@]}" tests/e2e/test_decode_gpu.py \
    tests/e2e/test_checksum_gpu.py tests/e2e/test_oom_gpu.py tests/e2e/test_memory_gpu.py \
    tests/e2e/test_ipc_gpu.py tests/e2e/test_liger_gpu.py tests/e2e/test_families_gpu.py \
    tests/e2e/test_activations_gpu.py
  pair_item tests_pair 130 "${pytest_gpu[@]}" -x tests/e2e/test_cp_gpu.py \
    tests/e2e/test_weights_gpu.py
  item demo1 150 env LAYOUTS=one DEMO_TIMEOUT=140 bash benchmarks/gpu_demo.sh "$out/demo"
  pair_item demo2 200 env LAYOUTS=two DEMO_TIMEOUT=190 bash benchmarks/gpu_demo.sh "$out/demo"
}

main_job() {  # main_job NAME SHAPE YAML SECONDS [overrides]
  local name=$1 shape=$2 yaml=$3 limit=$4; shift 4
  local root run_dir
  root=$(python3 -c "import yaml,sys; print(yaml.safe_load(open('$yaml'))['model']['path'])")
  run_dir=$(python3 -c "import yaml; print(yaml.safe_load(open('$yaml'))['run_dir'])")
  item "${name}_prep" 90 python3 benchmarks/grpo_1p5b.py --shape "$shape" --root "$(dirname "$root")"
  item "$name" "$limit" python3 -m fsdpfn run "$yaml" --overwrite "$@"
  item "${name}_stages" 30 python3 benchmarks/stages.py "$run_dir"
  cp "$run_dir/metrics.jsonl" "$out/${name}_metrics.jsonl" 2>/dev/null
  # a run's checkpoints (20 GB at 1.5B with the fp32 state) and model directory would fill the
  # machine's disk for the items after it
  rm -rf "$run_dir" "$(dirname "$root")"
}

main() {
  main_job llama1b llama-3.2-1b examples/gpu/grpo_llama_1b.yaml 300
  main_job qwen7b qwen2-7b examples/gpu/grpo_qwen2_7b.yaml 420
  main_job qwen1p5b qwen2-1.5b examples/gpu/grpo_qwen2_1p5b.yaml 280 steps=5
}

decode() {
  # a fresh machine's first server start, warm-up and capture took over 110 s for one shape
  item rollout 300 python3 benchmarks/rollout.py --no-concurrent --rows 512 1024
  # shared prompts at prompts of 1,024 tokens, one client and one client per prompt
  item rollout_long_prompts 300 python3 benchmarks/rollout.py --rows 512 --slots 512 --prompt 1024
  item decode_profile 140 python3 benchmarks/decode_profile.py --rows 512 --new 64
  item decode_attention 60 python3 benchmarks/decode_attention.py
  item decode_attention_equal 60 python3 benchmarks/decode_attention.py --rows 512 --equal 512
  item decode_gemm 90 python3 benchmarks/decode_gemm.py
  item decode_gemm_triton 150 python3 benchmarks/decode_gemm_triton.py
  item decode_overlap 60 python3 benchmarks/decode_overlap.py
  item decode_fp8 60 python3 benchmarks/decode_fp8.py --rows 512 1024
  item decode_kv_fp8 60 python3 benchmarks/decode_kv_fp8.py
  # the server with its float8 KV cache (--kv-cache-dtype fp8_e4m3) at 512 and 1,024 rows
  item rollout_kv_fp8 300 python3 benchmarks/rollout.py --no-concurrent --rows 512 1024 \
    --kv-cache-dtype fp8_e4m3
  # the network step alone (CUDA graphs), without and with the fused add and norm
  item decode_step 170 python3 benchmarks/decode_step.py --rows 512 --options \
    "fused, triton, rope-kv" "fused, triton, rope-kv, add-norm"
  item answer 120 python3 benchmarks/answer.py --device cuda --rows 512 --new 1024 --max-len 1280
}

train() {
  item mfu 420 python3 benchmarks/mfu.py --out "$out/mfu.jsonl"
  item timing 200 python3 benchmarks/timing.py --out "$out/timing" --steps 3 --memory
  item defaults 150 python3 benchmarks/defaults.py
}

push() {
  item checksum 60 python3 benchmarks/checksum.py
  pair_item push 150 python3 benchmarks/push.py --pushes 6 --sglang
}

cp_suite() {
  pair_item cp 300 torchrun --nproc-per-node 2 benchmarks/cp.py --out "$out/cp.jsonl" \
    --cells dp2:65536 cp2:65536 cp2:131072 cp2:262144
  # the longest row: one 524,288-token sequence of the 7B shape over two GPUs, with the bf16
  # state and the per-layer step (one step of a few minutes; no forward_logp beside it)
  pair_item cp_longest 560 torchrun --nproc-per-node 2 benchmarks/cp.py --out "$out/cp.jsonl" \
    --cells cp2:524288 --sequences 1 --state per_layer_bf16 --no-forward
}

memory() {
  item mem_cost 250 python3 benchmarks/memory.py cost --shape 1.5B --steps 2 --timeout 120
  # compile beside the default and the per-layer step: each timed step's seconds and the graphs
  # compiled during them (BENCHMARKS, "Memory: cost of each option": a one-off to place)
  item mem_cost_compile 200 python3 benchmarks/memory.py cost --shape 1.5B --steps 4 \
    --timeout 90 --options default per_layer --compile
  item mem_largest 300 python3 benchmarks/memory.py largest --shapes 14B \
    --options per_layer_bf16 --steps 1 --timeout 290
  item mem_longest 580 python3 benchmarks/memory.py longest --options default per_layer_bf16 \
    --steps 1 --seq 32768 --max-seq 262144 --timeout 150
  item build 480 python3 benchmarks/build.py --timeout 150
}

lora() {
  # compiled blocks with LoRA against eager LoRA (a test kept out of CPU CI by its cold compile)
  item lora_test 300 "${pytest_gpu[@]}" tests/e2e/test_lora_gpu.py
  item lora 200 torchrun --nproc-per-node 1 benchmarks/lora.py --steps 3 --ac
  # EngineConfig.compile with LoRA and without, on the 7B shape (the compile in the warm-up)
  item lora_compile 300 torchrun --nproc-per-node 1 benchmarks/lora.py --steps 3 --ac \
    --modes r16 r16+compile full full+compile
  item lora_large 250 torchrun --nproc-per-node 1 benchmarks/lora.py --model 32B --modes r16 \
    --steps 2 --ac
}

for suite in "$@"; do
  case $suite in
    check) check ;;
    main) main ;;
    main_llama1b) main_job llama1b llama-3.2-1b examples/gpu/grpo_llama_1b.yaml 300 ;;
    decode) decode ;;
    train) train ;;
    push) push ;;
    cp) cp_suite ;;
    memory) memory ;;
    lora) lora ;;
    *) echo "unknown suite $suite (check, main, main_llama1b, decode, train, push, cp, memory,"\
         "lora)"; exit 2 ;;
  esac
done
(cd "$out" && tar czf results.tgz --exclude=items.txt --exclude=results.tgz . 2>/dev/null)
cat "$out/items.txt"
