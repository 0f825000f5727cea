"""Start-up of ``fsdpfn run``: seconds from the command to the trainer ranks' start, to the first
step and to the exit, with the CPU seconds of the whole process tree, over a few runs of a short
recipe (the SFT example, 3 steps, no checkpoints but the last; or the GRPO example, 3 steps after
10 warm-up steps, with its rollout server). Prints one table.

    python benchmarks/startup.py                          # CPU ranks, 3 runs
    python benchmarks/startup.py --device cuda --runs 5
    python benchmarks/startup.py --example grpo
    python benchmarks/startup.py --python-path ../old     # another tree of the project

``--python-path`` puts that tree first on PYTHONPATH (the same command, another version of the
launcher), so two versions can be compared in one session on one host.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# each example's overrides: 3 steps, no evaluation; GRPO's warm-up cut to 10 steps
EXAMPLES = {"sft": ["steps=3", "eval_every=0"],
            "grpo": ["steps=3", "warmup.steps=10", "warmup.target_reward=null",
                     "prompts_per_step=4", "eval.every=0"]}


def one_run(args, run_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    tree = Path(args.python_path).resolve() if args.python_path else ROOT
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "fsdpfn", "run", str(tree / "examples" / f"{args.example}.yaml"),
           f"run_dir={run_dir}", *EXAMPLES[args.example], f"launch.device={args.device}",
           f"launch.nproc={args.nproc}", *args.overrides]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tree)
    marks, tail = {}, []
    for line in proc.stderr:
        now = time.monotonic() - t0
        tail = (tail + [line])[-20:]
        if "trainer rank(s)" in line:
            marks.setdefault("ranks", now)
        if re.search(r"\b1/3\b", line):
            marks.setdefault("first step", now)
    rc = proc.wait()
    marks["exit"] = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    marks["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc != 0:
        raise SystemExit(f"fsdpfn run exited {rc}:\n" + "".join(tail))
    return marks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--example", default="sft", choices=sorted(EXAMPLES))
    p.add_argument("--python-path", default=None, help="a tree of the project to run instead")
    p.add_argument("overrides", nargs="*", help="more overrides for the recipe")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fsdpfn_startup_"))
    rows = []
    try:
        for i in range(args.runs):
            rows.append(one_run(args, root / f"run{i}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tree = args.python_path or str(ROOT)
    print(f"fsdpfn run examples/{args.example}.yaml {' '.join(EXAMPLES[args.example])}, "
          f"{args.nproc} rank(s) on {args.device}; "
          f"tree {tree}; {args.runs} runs")
    cols = ["ranks", "first step", "exit", "cpu"]
    print("| run | " + " | ".join(f"to {c} (s)" if c != "cpu" else "CPU (s)" for c in cols)
          + " |")
    print("|---" * (len(cols) + 1) + "|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | " + " | ".join(f"{r.get(c, float('nan')):.2f}" for c in cols) + " |")
    med = {c: statistics.median(r.get(c, float("nan")) for r in rows) for c in cols}
    print("| median | " + " | ".join(f"{med[c]:.2f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
