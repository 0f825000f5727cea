"""Long-sequence benchmark (two GPUs): dp=2 against cp=2 (Ulysses) on a Qwen2-7B-shaped model with
activation checkpointing, at 16k to 131k tokens per sequence.

    torchrun --nproc-per-node 2 benchmarks/cp.py                       # 16k 32k 64k 128k, both
    torchrun --nproc-per-node 2 benchmarks/cp.py --lengths 16384 131072 --layouts cp2
    torchrun --nproc-per-node 2 benchmarks/cp.py --smoke               # a tiny shape, seconds
    torchrun --nproc-per-node 2 benchmarks/cp.py --model qwen3-1.7B --cells cp2:262144
    torchrun --nproc-per-node 2 benchmarks/cp.py --cells cp2:524288 --sequences 1 \
        --state per_layer_bf16 --no-forward              # the longest row: one per step
    torchrun --nproc-per-node 2 benchmarks/cp.py --smoke --device cpu   # gloo, on a CPU

Both layouts see the same global batch: two sequences of L tokens (``--sequences``; with one,
only cp=2 has work on both GPUs). dp=2 gives each rank one whole
sequence; cp=2 gives both ranks both sequences, each rank holding half of every token of the pack
(so the per-rank token count is L in both). The token budget is L per rank
(``max_tokens_per_mb``, per cp rank under cp). Measured per (layout, L): forward_logp seconds,
ppo_step seconds (one optimizer step), tokens per second per GPU of the ppo_step, and the peak
GPU memory of the ppo_step; a layout that runs out of memory is reported as OOM. Random init from
the config (bf16 compute; ``--state``: fp32 master weights and AdamW state by default, or the
memory options of benchmarks/memory.py, by its names: ``bf16`` optimizer state, the
``per_layer`` optimizer step, both, and the offload options), flash varlen attention on CUDA.
``--no-forward`` skips the forward_logp (the ppo_step then takes its ratio's denominator from its
own forward, ``old_logp_from="forward"``, exact at one minibatch), which at 524,288 tokens is
minutes of a call.
Prints one Markdown table (rank 0) and appends JSON lines to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdpfn as ff  # noqa: E402
from _table import print_markdown_table  # noqa: E402 - benchmarks/ is this script's folder
from memory import OPTIONS as STATES  # noqa: E402 - name -> (optimizer_dtype, FSDPConfig fields)
from fsdpfn.errors import MicroBatchOOMError  # noqa: E402

QWEN2_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                max_position_embeddings=131072, rope_theta=1_000_000.0,
                tie_word_embeddings=False)
QWEN3_1_7B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=262144, rope_theta=1_000_000.0,
                  tie_word_embeddings=True)
MODELS = {"7B": QWEN2_7B, "qwen3-1.7B": QWEN3_1_7B}
SMOKE = dict(QWEN2_7B, vocab_size=4096, hidden_size=256, intermediate_size=512,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LAYOUTS = {"dp2": dict(dp=2, cp=1), "cp2": dict(dp=1, cp=2)}


def _batch(length: int, vocab: int, sequences: int = 2):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, vocab, (sequences, length), generator=g)
    attn = torch.ones(sequences, length, dtype=torch.bool)
    loss = attn.clone()
    loss[:, : length // 8] = False  # a prompt, then the response trained on
    adv = torch.where(loss, torch.randn(sequences, length, generator=g), 0)
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss,
                       "advantages": adv}, batch_size=[sequences])


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


def _peak_gib(device: str):
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else ""


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MicroBatchOOMError)) or \
        "out of memory" in str(exc).lower()


def measure(layout: str, length: int, model: dict, sequences: int = 2, state_name: str = "default",
            forward: bool = True, device: str = "cuda") -> dict:
    """One (layout, L) cell: build the state, forward_logp (unless ``forward`` is False), one
    ppo_step; free everything."""
    row = {"layout": layout, "tokens/seq": length, "sequences": sequences, "state": state_name}
    state = None
    try:
        optimizer_dtype, fsdp = STATES[state_name]
        mesh = ff.build_mesh(ff.ParallelStrategy(**LAYOUTS[layout]), device_type=device)
        config = ff.EngineConfig(model_config=model, gradient_checkpointing=True,
                                 optimizer_dtype=optimizer_dtype, fsdp=ff.FSDPConfig(**fsdp),
                                 mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=length),
                                 optimizer=ff.OptimizerConfig(lr=1e-6))
        build_start = time.perf_counter()
        state = ff.shard_model(config, mesh)
        row["build s"] = round(time.perf_counter() - build_start, 1)
        batch = ff.shard_batch(_batch(length, model["vocab_size"], sequences), mesh)
        ppo = ff.PPOConfig()
        if forward:
            batch, fwd_s = _timed(lambda: ff.forward_logp(state, batch, out_key="old_logp"))
            row["forward_logp s"] = round(fwd_s, 2)
        else:  # one minibatch: the ratio's denominator from the step's own forward, exactly
            row["forward_logp s"] = "skipped"
            ppo = ff.PPOConfig(old_logp_from="forward")
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        (state, _), step_s = _timed(lambda: ff.ppo_step(state, batch, ppo))
        per_gpu = sequences * length / 2  # the global batch's tokens over two GPUs
        row.update({"ppo_step s": round(step_s, 2), "tok/s/GPU": round(per_gpu / step_s),
                    "peak GiB": _peak_gib(device)})
    except Exception as exc:  # noqa: BLE001 - an OOM is a result of the table
        if not _is_oom(exc):
            raise
        row.update({"forward_logp s": "OOM", "ppo_step s": "OOM"})
    finally:
        state = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--model", default="7B", choices=list(MODELS))
    parser.add_argument("--cells", nargs="+", default=None, metavar="LAYOUT:LENGTH",
                        help="only these cells, in order (e.g. cp2:131072 dp2:65536)")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, short sequences")
    parser.add_argument("--out", default="cp_bench.jsonl")
    parser.add_argument("--sequences", type=int, default=2, help="sequences of L tokens a step")
    parser.add_argument("--state", default="default", choices=list(STATES),
                        help="the optimizer state's memory option (benchmarks/memory.py's names)")
    parser.add_argument("--no-forward", action="store_true",
                        help="skip forward_logp; the step's own forward gives old_logp")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    model, lengths = (SMOKE, [512, 2048]) if args.smoke else (MODELS[args.model], args.lengths)
    cells = ([(c.split(":")[0], int(c.split(":")[1])) for c in args.cells] if args.cells else
             [(layout, length) for length in lengths for layout in args.layouts])
    if args.sequences < 2 and any(layout == "dp2" for layout, _ in cells):
        parser.error(f"--sequences {args.sequences}: dp=2 needs at least two sequences, one a rank")
    rows = []
    for layout, length in cells:
        row = measure(layout, length, model, args.sequences, args.state, not args.no_forward,
                      args.device)
        rows.append(row)
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    if int(os.environ.get("RANK", 0)) == 0:
        print_markdown_table(rows, ("layout", "tokens/seq"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
