"""The defaults are the fast, safe path (one GPU): ``EngineConfig()`` with nothing set but the
model, against the settings the other benchmarks tune by hand, on a 96-sequence RL batch of the
Qwen3-1.7B shape (about 160k tokens).

    python benchmarks/defaults.py              # Qwen3-1.7B shape, 96 sequences in [256, 3072]
    python benchmarks/defaults.py --cpu        # a smoke run (tiny model, CPU)

Per setting: forward_logp seconds (the second call), ppo_step seconds (median of --steps after a
warm-up), tokens/s and the step's peak device memory. A setting that fails reports its error's first line (an
out-of-memory error is a result: the defaults must not produce one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from run import rl_batch  # noqa: E402 - benchmarks/run.py: the RL batch

import fsdpfn as ff  # noqa: E402
from fsdpfn import keys as K  # noqa: E402
QWEN3_1_7B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                  tie_word_embeddings=True)
TINY = dict(QWEN3_1_7B, vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SETTINGS = {  # name -> EngineConfig keywords beyond the model
    "EngineConfig() defaults": {},
    "tuned (16k micro-batches, bf16, no checkpointing)": dict(
        dtype="bfloat16", gradient_checkpointing=False,
        mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=16384)),
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(name: str, extra: dict, model: dict, batch, device: str, steps: int) -> dict:
    row = {"setting": name}
    try:
        mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type=device)
        config = ff.EngineConfig(model_config=model, optimizer=ff.OptimizerConfig(lr=1e-6),
                                 **extra)
        state = ff.shard_model(config, mesh)
        row["dtype / mb tokens"] = f"{config.dtype} / {config.mb_spec.max_tokens_per_mb}"
        ff.forward_logp(state, batch, out_key=K.OLD_LOGP)  # warm-up: the process's first call
        _sync(device)
        start = time.perf_counter()
        batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
        _sync(device)
        row["forward_logp s"] = round(time.perf_counter() - start, 2)
        times = []
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps + 1):
            _sync(device)
            start = time.perf_counter()
            state, stats = ff.ppo_step(state, batch, ff.PPOConfig())
            _sync(device)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        tokens = int(batch[K.ATTENTION_MASK].sum())
        row.update({"ppo_step s": round(seconds, 2), "tokens/s": round(tokens / seconds),
                    "peak GiB": (round(torch.cuda.max_memory_allocated() / 2**30, 1)
                                 if device == "cuda" else "")})
        del state
    except Exception as exc:  # noqa: BLE001 - out of memory, or anything else: a result
        row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=96)
    parser.add_argument("--lo", type=int, default=256)
    parser.add_argument("--hi", type=int, default=3072)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="a smoke run: tiny model on CPU")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    model = TINY if args.cpu else QWEN3_1_7B
    seqs, lo, hi = (8, 16, 64) if args.cpu else (args.seqs, args.lo, args.hi)
    batch, lens = rl_batch(seqs, lo, hi, model["vocab_size"], seed=3)
    print(f"# {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch "
          f"{torch.__version__}: {seqs} sequences, {sum(lens)} tokens", flush=True)
    rows = [measure(name, extra, model, batch, device, args.steps)
            for name, extra in SETTINGS.items()]
    print_markdown_table(rows, ("setting", "dtype / mb tokens", "forward_logp s", "ppo_step s",
                                "tokens/s", "peak GiB"))


if __name__ == "__main__":
    main()
