"""Trainer-rollout mismatch diagnostics of GRPO runs, as a BENCHMARKS.md table.

Reads each run's metrics.jsonl (grpo phase) and prints one row per run: the ppo_step stats
behav_gap_mean / behav_gap_max / behav_kl (trainer old_logp vs the rollout server's behav_logp
over loss tokens), the truncated / masked fractions, on_policy_gap, and reward first -> last.

Run on a GPU host (the built-in rollout server on its own GPU), one run per option, then:
    fsdpfn run examples/grpo.yaml run_dir=runs/diag_none dtype=bfloat16 steps=30 \
        ppo.check_on_policy=true --overwrite
    fsdpfn run examples/grpo.yaml run_dir=runs/diag_tis dtype=bfloat16 steps=30 \
        ppo.behav_correction=tis --overwrite
    fsdpfn run examples/grpo.yaml run_dir=runs/diag_mis_geo dtype=bfloat16 steps=30 \
        ppo.behav_correction=mis ppo.behav_level=geometric ppo.behav_high=1.01 --overwrite
    python benchmarks/behav_diagnostics.py runs/diag_none runs/diag_tis runs/diag_mis_geo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = ("behav_gap_mean", "behav_gap_max", "behav_kl", "behav_trunc_frac", "behav_mask_frac",
           "behav_seq_mask_frac", "on_policy_gap")


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("phase") == "grpo"]


def summary(run_dir: Path) -> str:
    """One table row: the mean over steps of each column (max for *_max), reward first -> last."""
    steps = rows(run_dir)
    cells = []
    for key in COLUMNS:
        values = [r[key] for r in steps if r.get(key) is not None]
        if not values:
            cells.append("–")
            continue
        value = max(values) if key.endswith("_max") else sum(values) / len(values)
        cells.append(f"{value:.3g}")
    reward = f"{steps[0]['reward_mean']:.3f} → {steps[-1]['reward_mean']:.3f}" if steps else "–"
    return f"| {run_dir.name} | {len(steps)} | " + " | ".join(cells) + f" | {reward} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    print("| run | steps | " + " | ".join(COLUMNS) + " | reward first → last |")
    print("|---|---|" + "---|" * len(COLUMNS) + "---|")
    for run_dir in args.run_dirs:
        print(summary(run_dir))


if __name__ == "__main__":
    main()
