"""Where an `fsdpfn run` spent its time: per-stage seconds per RL step from run_dir/metrics.jsonl.

    python benchmarks/stages.py runs/demo [runs/other ...] [--skip 1]

One row per run: mean seconds of each stage over the steps (the first ``--skip`` steps left out:
they include compilation and allocator warm-up; a stage a step did not run, as a checkpoint,
counts 0 s there), the step's seconds (its checkpoint included), tokens/s, generated tokens/s,
response length (its clipped fraction: response_clip_frac), and reward of the first and last
five steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_markdown_table  # noqa: E402

STAGES = ("generate", "reward", "ref_logp", "old_logp", "values", "train", "push", "checkpoint")


def summarize(run_dir: Path, skip: int) -> dict:
    phase = json.loads((run_dir / "summary.json").read_text())["recipe"] \
        if (run_dir / "summary.json").is_file() else "grpo"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("phase") == phase]
    timed = rows[skip:] or rows

    def mean(key):
        """Over the timed steps; a stage a step did not run (a checkpoint) counts as 0 s."""
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        if not vals:
            return ""
        if key.endswith("_seconds"):
            return round(sum(vals) / len(timed), 3)
        return round(sum(vals) / len(vals), 3)

    out = {"run": run_dir.name, "steps": len(rows), "s/step": mean("seconds")}
    out.update({f"{s} s": mean(f"{s}_seconds") for s in STAGES if mean(f"{s}_seconds") != ""})
    out.update({"tokens/s": mean("tokens_per_s"), "gen tok/s": mean("generated_tokens_per_s"),
                "resp len": mean("response_len_mean"), "clip frac": mean("response_clip_frac")})
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    if rewards:
        k = min(5, len(rewards))
        out["reward first/last 5"] = (f"{sum(rewards[:k]) / k:.3f} -> "
                                      f"{sum(rewards[-k:]) / k:.3f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument("--skip", type=int, default=1)
    args = p.parse_args()
    print_markdown_table([summarize(d, args.skip) for d in args.run_dirs], first=("run",))


if __name__ == "__main__":
    main()
