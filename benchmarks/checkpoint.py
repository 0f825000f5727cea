"""Checkpoint benchmark (one GPU): save_checkpoint and load_checkpoint of a Qwen2-1.5B-shaped
model with its AdamW state, with and without the integrity checksums, measured in the same run.

    python benchmarks/checkpoint.py                        # Qwen2-1.5B shape, 3 rounds
    python benchmarks/checkpoint.py --dir /nvme/tmp --rounds 5
    python benchmarks/checkpoint.py --cpu                  # a smoke run (tiny model, CPU)

The state is a one-rank fsdpfn state (random init from the config, bf16 compute, fp32 master
weights and Adam moments: about 18.5 GB of checkpoint data) after one SFT step. Each round saves
with ``checksums=False`` and loads that with ``verify=False``, and saves with ``checksums=True``
and loads that with ``verify=True`` (alternating which pair goes first), each load into the live
state; the directory is deleted before every save, so only one checkpoint is on disk. Loads
read what the saves just wrote, so they run from the page cache as far as it holds them (the same
for both variants). Also measured: the device checksum pass alone
(``fsdpfn.checkpoint.integrity.local_checksums``) and an async save's time to return and to publish.
Prints one table: median seconds per operation and the checksums' overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdpfn as ff  # noqa: E402
from _table import print_markdown_table  # noqa: E402 - benchmarks/ is this script's folder
from fsdpfn import integrity  # noqa: E402
from fsdpfn.checkpoint import _to_save  # noqa: E402 - the state dict save_checkpoint writes

QWEN2_1_5B = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                  intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
TINY = dict(QWEN2_1_5B, vocab_size=1024, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _batch(vocab: int, device: str):
    from tensordict import TensorDict

    ids = torch.randint(0, vocab, (2, 128))
    attn = torch.ones(2, 128, dtype=torch.bool)
    loss = attn.clone()
    loss[:, 0] = False
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                      batch_size=[2])


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/tmp/fsdpfn-ckpt-bench",
                        help="where the checkpoint is written (needs ~20 GB free)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="a smoke run: tiny model on CPU")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu for a smoke run)")
    from transformers import Qwen2Config

    spec = TINY if args.cpu else QWEN2_1_5B
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type=device)
    config = ff.EngineConfig(model_config=Qwen2Config(**spec).to_dict(), dtype="bfloat16",
                             optimizer=ff.OptimizerConfig(lr=1e-6))
    state = ff.shard_model(config, mesh)
    state, _ = ff.sft_step(state, _batch(spec["vocab_size"], device), ff.SFTConfig())
    n_params = sum(p.numel() for p in state.model.parameters())
    path = os.path.join(args.dir, "ckpt")
    os.makedirs(args.dir, exist_ok=True)

    times: dict[str, list[float]] = {}

    def measure(name, fn):
        times.setdefault(name, []).append(_timed(fn, device))

    def save(checksums: bool, async_save: bool = False):
        shutil.rmtree(path, ignore_errors=True)
        handle = None

        def call():
            nonlocal handle
            handle = ff.save_checkpoint(state, path, checksums=checksums, async_save=async_save)

        suffix = "on" if checksums else "off"
        if async_save:
            measure(f"async save returns, checksums {suffix}", call)
            measure(f"async save wait(), checksums {suffix}", handle.wait)
        else:
            measure(f"save, checksums {suffix}", call)

    def load(verify: bool):
        nonlocal state

        def call():
            nonlocal state
            state, _ = ff.load_checkpoint(state, path, verify=verify)

        measure(f"load, verify {'on' if verify else 'off'}", call)

    state_dict = _to_save(state, "saved")
    integrity.local_checksums(state_dict)  # warm-up
    for _ in range(args.rounds):
        measure("device checksum pass alone", lambda: integrity.local_checksums(state_dict))
    state_dict = None
    size = 0
    for r in range(args.rounds):
        for checked in ((False, True) if r % 2 == 0 else (True, False)):
            save(checked)
            size = _bytes(path)
            load(checked)
        save(True, async_save=True)
        save(False, async_save=True)
    shutil.rmtree(path, ignore_errors=True)

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# {name}, torch {torch.__version__}, Qwen2 {'tiny' if args.cpu else '1.5B'} shape, "
          f"{n_params / 1e9:.2f} B parameters, checkpoint {size / 1e9:.2f} GB "
          f"(fp32 weights + AdamW moments), {args.rounds} rounds, in {args.dir}", flush=True)
    rows = []
    for op, values in times.items():
        median = statistics.median(values)
        row = {"operation": op, "median s": f"{median:.3f}",
               "min s": f"{min(values):.3f}", "GB/s": f"{size / 1e9 / median:.2f}"}
        base = op.replace(" on", " off") if op.endswith(" on") else None
        if base in times:
            extra = median - statistics.median(times[base])
            share = 100 * extra / statistics.median(times[base])
            row["overhead"] = f"{extra:+.3f} s ({share:+.1f}%)"
        rows.append(row)
    print_markdown_table(rows, ("operation", "median s", "min s", "GB/s", "overhead"))
    print(json.dumps({k: [round(v, 4) for v in vs] for k, vs in times.items()}))


if __name__ == "__main__":
    main()
