"""Where a ppo_step's time goes on a GPU, what timing costs, and a trace of one step.

    python benchmarks/timing.py --out /tmp/fsdpfn_timing            # one GPU, 1.5B shape
    python benchmarks/timing.py --out /tmp/fsdpfn_timing --steps 8 --memory

The ppo_step of BENCHMARKS.md (b): a Qwen2-1.5B-shaped model (random init), 64 sequences with
lengths uniform in [256, 4096], 16k-token micro-batches, defaults otherwise. Prints three tables:

  1. the stage split of the stats (time_plan ... time_total, peak_memory_gb, tokens_per_s, mfu)
     per step, to set against the step of BENCHMARKS.md's "Training step MFU" section;
  2. the cost of timing: steps alternating EngineConfig.timing on and off (the same weights and
     batch; the off steps run a copy of the state's handle with timing=False), the median wall
     time of each (host clock around a synchronised step) and the overhead (target: under 1%);
  3. the files written by fsdpfn.profile for one traced iteration (forward_logp + ppo_step):
     step<k>_rank0.json (open in https://ui.perfetto.dev) and, with --memory, the allocator
     snapshot step<k>_rank0.memory.pickle (https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import run as bench  # noqa: E402 - benchmarks/run.py: model shapes, the RL batch, the state
from _table import print_markdown_table  # noqa: E402

import fsdpfn as ff  # noqa: E402
from fsdpfn import keys as K  # noqa: E402
STAGES = ("time_plan", "time_forward", "time_backward", "time_optimizer", "time_comm")


def with_timing(state, on: bool):
    """The same live state with EngineConfig.timing set (the handle shares the lease: use only
    the returned one from here on)."""
    return attrs.evolve(state, config=attrs.evolve(state.config, timing=on))


def step_row(name: str, stats, wall: float) -> dict:
    row = {"run": name, "wall s": round(wall, 3)}
    row.update({k[5:]: round(float(stats[k]), 3) for k in (*STAGES, "time_total")})
    row["stages / total"] = round(sum(float(stats[k]) for k in STAGES)
                                  / float(stats["time_total"]), 3)
    row["peak GiB"] = round(float(stats["peak_memory_gb"]), 1)
    row["tokens/s"] = round(float(stats["tokens_per_s"]))
    if "mfu" in stats.keys():
        row["MFU"] = f"{100 * float(stats['mfu']):.1f}%"
    return row


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(state, batch, config):
    sync()
    start = time.perf_counter()
    state, stats = ff.ppo_step(state, batch, config)
    sync()
    return state, stats, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the trace and a JSON summary")
    p.add_argument("--steps", type=int, default=6, help="steps per setting (timing on / off)")
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--rate", type=float, default=0.0,
                   help="peak TFLOP/s for MFU (0: measured by fsdpfn.engine.timing)")
    p.add_argument("--memory", action="store_true", help="allocator snapshot of the traced step")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model and batch (a check of this script, CPU or GPU)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg, n_seqs, lo, hi = bench.QWEN2_1_5B, 64, 256, 4096
    if args.tiny:
        cfg, n_seqs, lo, hi = dict(cfg, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256), 8, 16, 64
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    bench.log(f"# {device}, torch {torch.__version__}, Qwen2-1.5B shape{' (tiny)' * args.tiny}")
    state, _ = bench.fsdpfn_state(cfg, budget=args.budget)
    if args.rate:
        state = attrs.evolve(state, config=attrs.evolve(state.config, peak_tflops=args.rate))
    batch, _ = bench.rl_batch(n_seqs, lo, hi, cfg["vocab_size"], seed=1)
    batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
    config = bench.ppo_cfg()
    for _ in range(2):  # warm-up: allocator, kernels, the peak-rate GEMM
        state, _, _ = timed_step(state, batch, config)

    # 1 + 2: alternate timing on and off
    rows, walls = [], {True: [], False: []}
    for i in range(2 * args.steps):
        on = i % 2 == 0
        state = with_timing(state, on)
        state, stats, wall = timed_step(state, batch, config)
        walls[on].append(wall)
        if on:
            rows.append(step_row(f"step {i // 2}", stats, wall))
    print_markdown_table(rows, first=("run",))
    on, off = statistics.median(walls[True]), statistics.median(walls[False])
    cost = {"timing on, median s": round(on, 4), "timing off, median s": round(off, 4),
            "overhead": f"{100 * (on - off) / off:+.2f}%",
            "steps each": args.steps}
    print_markdown_table([cost], first=())

    # 3: one traced RL iteration (forward_logp + ppo_step), the second inside the block
    state = with_timing(state, True)
    with ff.profile(args.out, steps=[1], memory=args.memory) as session:
        for _ in range(2):
            batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
            state, stats = ff.ppo_step(state, batch, config)
    traced = step_row("traced step", stats, float(stats["time_total"]))
    print_markdown_table([traced], first=("run",))
    files = [{"file": str(f), "MB": round(f.stat().st_size / 1e6, 1)} for f in session.written]
    print_markdown_table(files, first=())
    trace = json.loads(session.written[0].read_text())  # loads as JSON (Perfetto reads it)
    ranges = sorted({e["name"] for e in trace["traceEvents"]
                     if isinstance(e, dict) and str(e.get("name", "")).startswith("fsdpfn.")})
    print("fsdpfn ranges in the trace:", ", ".join(ranges))
    forward = ff.last_timings(state)["forward_logp"]
    print("forward_logp:", json.dumps({k: round(v, 4) for k, v in forward.items()}))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"steps": rows, "cost": cost, "traced": traced, "forward_logp": forward,
                   "files": files}, f, indent=1)


if __name__ == "__main__":
    main()
