"""LoRA against full fine-tuning at a 7B shape: peak GPU memory and training tokens/s.

    torchrun --nproc-per-node 8 benchmarks/lora.py                    # rank 16 and 64 vs full
    torchrun --nproc-per-node 1 benchmarks/lora.py --layers 8         # one GPU: a shorter stack
    torchrun --nproc-per-node 8 benchmarks/lora.py --modes r16 --tokens 32768
    torchrun --nproc-per-node 1 benchmarks/lora.py --model 32B --modes r16 --ac   # larger shapes

``--model`` 14B or 32B takes the Qwen2.5 shape of that size instead; a mode that runs out of
memory is a row of the table (its error), not a failed run.

A Qwen2-7B-shaped model (hidden 3584, 28 layers, 28/4 heads, MLP 18944, vocabulary 152064),
randomly initialised (nothing is downloaded), bfloat16 compute, float32 master weights and Adam
moments for what is trained, FSDP2 over every GPU (``--tp`` for tensor parallelism). For each mode
(``full``, ``r16``, ``r64``: LoRA of that rank on every linear of the decoder layers, alpha =
2·rank; a ``+compile`` suffix, e.g. ``r16+compile``, adds ``EngineConfig.compile``, whose compile
falls in the warm-up steps) it builds the state, runs ``--warmup`` then ``--steps`` sft_step calls
on random token rows of ``--seq-len`` tokens (``--tokens`` per rank per step), and reports per GPU:
the peak memory allocated (torch.cuda.max_memory_allocated) over the build and the timed steps,
trained parameters, and tokens/s of the timed steps (all ranks' tokens over the wall time). Each
mode frees its state before the next. Never collected by the test suite.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_markdown_table  # noqa: E402

import fsdpfn as ff  # noqa: E402

QWEN2_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, tie_word_embeddings=False)
MODELS = {"7B": QWEN2_7B,
          "14B": dict(QWEN2_7B, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                      num_attention_heads=40, num_key_value_heads=8),
          "32B": dict(QWEN2_7B, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                      num_attention_heads=40, num_key_value_heads=8)}


def _batch(tokens: int, seq_len: int, vocab: int, seed: int) -> TensorDict:
    rows = max(tokens // seq_len, 1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    attn = torch.ones(rows, seq_len, dtype=torch.bool)
    loss = attn.clone()
    loss[:, : seq_len // 4] = False  # a prompt quarter, as in SFT
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                      batch_size=[rows])


def _lora_of(mode: str):
    base = mode.removesuffix("+compile")
    if base == "full":
        return None
    rank = int(base.removeprefix("r"))
    return ff.LoRAConfig(rank=rank, alpha=2.0 * rank)


def run_mode(mode: str, args, mesh) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = MODELS[args.model]
    model = dict(base, num_hidden_layers=args.layers or base["num_hidden_layers"])
    cfg = ff.EngineConfig(model_config=model, dtype="bfloat16", optimizer=ff.OptimizerConfig(
        lr=1e-5), lora=_lora_of(mode), gradient_checkpointing=args.ac,
        compile=mode.endswith("+compile"),
        mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=args.mb_tokens))
    state = ff.shard_model(cfg, mesh)
    trained = sum(p.numel() for g in state.optimizer.param_groups for p in g["params"])
    n_trained = torch.tensor([trained], device=mesh.device)
    dist.all_reduce(n_trained)  # local shards, summed (tp replicas counted once each: rough)
    build_peak = torch.cuda.max_memory_allocated() / 2**30
    seed = 1000 * mesh.rank("dp")
    for i in range(args.warmup):
        state, _ = ff.sft_step(state, _batch(args.tokens, args.seq_len, model["vocab_size"],
                                             seed + i), ff.SFTConfig())
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    tokens = 0
    for i in range(args.steps):
        state, stats = ff.sft_step(state, _batch(args.tokens, args.seq_len, model["vocab_size"],
                                                 seed + 100 + i), ff.SFTConfig())
        tokens += int(stats["tokens"])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=mesh.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    row = {"mode": mode, "model": args.model, "layers": model["num_hidden_layers"],
           "gpus": dist.get_world_size(), "tp": args.tp,
           "trained params (M)": round(float(n_trained) / 1e6, 1),
           "build peak GiB": round(build_peak, 2), "peak GiB (max rank)": round(float(peak), 2),
           "tokens/s": round(tokens / seconds), "s/step": round(seconds / args.steps, 3),
           "loss": round(float(stats["loss"]), 3)}
    del state, stats
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=["full", "r16", "r64"])
    p.add_argument("--model", default="7B", choices=list(MODELS))
    p.add_argument("--layers", type=int, default=None, help="default: the model's")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--mb-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ac", action="store_true", help="activation checkpointing")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/lora.py needs CUDA GPUs (run it with torchrun on a GPU host)")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=args.tp))
    rows = []
    for mode in args.modes:
        try:
            rows.append(run_mode(mode, args, mesh))
        except torch.OutOfMemoryError as exc:  # a result of the table: this mode does not fit
            rows.append({"mode": mode, "model": args.model,
                         "error": f"out of memory: {str(exc).splitlines()[0][:100]}"})
            gc.collect()
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print_markdown_table(rows, first=("mode",))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
