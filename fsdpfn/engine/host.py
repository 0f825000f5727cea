"""What the host offers the engine: its available memory (torch-free, so the recipe's preflight
reads it before anything is built)."""

from __future__ import annotations

__all__ = ["available_host_memory"]


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
