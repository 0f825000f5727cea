"""One trainer rank of ``fsdpfn run`` (started by the launcher, fsdpfn.app.ranks, with
torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, ...). On several hosts, under torchrun,
after ``fsdpfn run FILE --prepare`` has checked the config and written run_dir (config.yaml, the
prepared data; it prints this command):

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --rdzv-backend c10d \
        --rdzv-endpoint $HEAD:29500 -m fsdpfn.app.recipes.worker \
        --config runs/job/config.yaml [--resume] [--rollout-url http://HOST:PORT]

With FSDPFN_LAUNCHER_PID set (``fsdpfn run`` sets it), the rank exits when that process does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fsdpfn.wire.lifeline import watch_launcher


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdpfn.app.recipes.worker")
    p.add_argument("--config", required=True, help="the resolved recipe config (YAML)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--rollout-url", default=None)
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="the launcher's placement (default: launch.device, auto resolved here)")
    p.add_argument("--transport", default=None, choices=("broadcast", "ipc", "disk"),
                   help="how weights reach the rollout server (default: rollout.transport)")
    args = p.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    # before the slow imports: a rank whose launcher was killed must not train unsupervised
    # (the parent-death signal covers a rank the launcher started; this, one started otherwise)
    watch_launcher(f"trainer rank {rank}")

    import torch
    import torch.distributed as dist

    from fsdpfn.app.recipes import load_recipe_config, run_recipe
    from fsdpfn.app.recipes.model import prepare_initial_model
    from fsdpfn.app.recipes.placement import resolve_dtype
    from fsdpfn.app.recipes.runtime import RunContext
    from fsdpfn.app.run_dir import check_started_by_hand

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    cfg = load_recipe_config(args.config)
    device = args.device or cfg.launch.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # one GPU per rank, of those the launcher made visible
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rollout = getattr(cfg, "rollout", None)
    transport = args.transport or (rollout.transport if rollout is not None else "broadcast")
    ctx = RunContext(run_dir=Path(cfg.run_dir), resume=args.resume,
                     rollout_url=args.rollout_url or getattr(rollout, "url", None),
                     device=device, dtype=resolve_dtype(cfg, device),
                     transport="broadcast" if transport == "auto" else transport)
    ctx.stop.install()
    # the launcher forwards Ctrl-C to the ranks by these pids, once this rank's stop handler is
    # in place (each rank runs in a session of its own: a terminal's Ctrl-C reaches the launcher)
    pid_file = ctx.run_dir / ".ranks" / f"rank{rank}.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(str(os.getpid()))
    try:
        check_started_by_hand(cfg, ctx.run_dir, resume=args.resume)
        prepare_initial_model(cfg.model, ctx.run_dir, rank=int(rank))
        seed_globals(cfg.seed, int(rank))
        run_recipe(cfg, ctx)
    except Exception as exc:  # noqa: BLE001 - reported as one line by the launcher
        pid_file.unlink(missing_ok=True)
        report_error(ctx.run_dir, rank, exc)
        os._exit(1)  # peers may wait in a collective: no process-group teardown
    finally:
        pid_file.unlink(missing_ok=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def seed_globals(seed: int, rank: int) -> None:
    """Rank ``rank``'s global generators (torch CPU and CUDA, python's random, numpy's) seeded
    from the run's ``seed``: what draws from them (LoRA's dropout, a user's reward or workflow
    code in the rank) repeats from run to run, and a checkpoint's saved RNG state is a function
    of the seed, so a resumed run continues the uninterrupted run's draws."""
    import random

    import torch

    value = (int(seed) * 1_000_003 + rank) % 2**32
    random.seed(value)
    torch.manual_seed(value)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(value)


def report_error(run_dir: Path, rank: str, exc: BaseException) -> None:
    """The failure of this rank for the launcher: run_dir/.ranks/error_rankN.json (type, one-line
    message, time), written before the traceback goes to stderr (the launcher's trainer.log),
    so the launcher knows what follows is the failure's trace and not for the terminal."""
    import json
    import time
    import traceback

    record = {"type": type(exc).__name__, "message": " ".join(str(exc).split())[:2000],
              "rank": int(rank), "time": time.time()}
    path = run_dir / ".ranks" / f"error_rank{rank}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.rename(path)
    except OSError:
        pass
    print(f"[fsdpfn] trainer rank {rank} failed:", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()


def _leave(code: int) -> None:
    """End the rank once its run is over (process group destroyed, files closed) without the
    interpreter's teardown: there, a C++ thread of the loaded extensions aborted finished ranks
    (SIGABRT, "terminate called without an active exception") about once in 10 to 20 runs of
    the PPO example on a loaded 2-core host, after every step and checkpoint had completed, and
    the job was reported failed. Streams and logging handlers are flushed first."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    _leave(main())
