"""What the host offers the engine: its available memory (torch-free, so the recipe's preflight
reads it before anything is built), and a process's garbage collector told what lives for good."""

from __future__ import annotations

import gc

__all__ = ["available_host_memory", "freeze_long_lived"]


def available_host_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: no check). What the
    recipe's preflight and its asynchronous checkpoints weigh their host memory against, and
    what the per-layer step's pinned mapping must fit in."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def freeze_long_lived() -> None:
    """Collect once, then move every object alive now out of the garbage collector's reach
    (``gc.freeze``): a long-running process of ours (a trainer rank at its loop's start, the
    rollout server once its model is loaded) holds some 400,000 objects of torch, transformers
    and its own setup that live until it ends, and every full collection walked them all (0.2
    to 0.3 s on a CPU core, during which the process, its other threads and the ranks waiting
    on it in a collective stand still). Later objects are collected as before. What was alive
    here and becomes cyclic garbage later is never collected, so call it where what is alive
    stays: after the setup, not inside a step. BENCHMARKS.md (Garbage collection) has the
    measurements."""
    gc.collect()
    gc.freeze()
