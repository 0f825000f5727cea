"""The GPUs' memory as the launcher finds it, from nvidia-smi (asking torch would start CUDA in
the launcher, which would then hold device memory for the whole run): each visible GPU's total
and what other processes already use on it. A run's memory estimate is held against what is
free on its trainer GPUs, so a GPU that another job (or a leftover server) holds is named before
the run starts instead of ending it in an out-of-memory error minutes later.

Visible GPUs follow ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, as CUDA reads it: the list ends
at the first entry that names no GPU); MIG instances, which nvidia-smi's per-GPU figures do not
describe, leave the figures unknown (None), and the run is checked against the total as before.
"""

from __future__ import annotations

import os
import subprocess
from typing import NamedTuple

__all__ = ["Gpu", "parse_gpus", "cuda_order", "host_gpus", "visible", "trainer_capacity",
           "BUSY_BYTES"]

MiB = 2 ** 20
GiB = 2 ** 30
# memory in use below this is not worth a word (a display server, the driver's own)
BUSY_BYTES = 1 * GiB


class Gpu(NamedTuple):
    """One physical GPU: nvidia-smi's index and UUID, its memory and what is in use, bytes."""

    index: int
    uuid: str
    total: float
    used: float


def parse_gpus(text: str) -> list[Gpu]:
    """nvidia-smi's ``--query-gpu=index,uuid,memory.total,memory.used
    --format=csv,noheader,nounits`` lines; a figure it cannot give ("[N/A]") counts as 0 used,
    and a line without a total is skipped."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            index, total = int(parts[0]), float(parts[2]) * MiB
        except ValueError:
            continue
        try:
            used = float(parts[3]) * MiB
        except ValueError:
            used = 0.0
        gpus.append(Gpu(index, parts[1], total, used))
    return gpus


def cuda_order(gpus: list[Gpu], visible: str | None) -> list[Gpu] | None:
    """The GPUs a process sees, in CUDA's order, under ``CUDA_VISIBLE_DEVICES`` = ``visible``
    (None: all, by index); None where an entry is a MIG instance."""
    if visible is None:
        return sorted(gpus, key=lambda g: g.index)
    seen = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith("MIG-"):
            return None
        match = [g for g in gpus if (entry.isdigit() and g.index == int(entry))
                 or (entry.startswith("GPU-") and g.uuid.startswith(entry))]
        if len(match) != 1 or match[0] in seen:
            break  # CUDA stops at the first entry that names no (new) GPU
        seen.append(match[0])
    return seen


def host_gpus() -> list[Gpu] | None:
    """Every GPU of the host with its memory (nvidia-smi's one query), or None where
    nvidia-smi does not answer."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gpus(out) or None


def visible(gpus: list[Gpu]) -> list[Gpu] | None:
    """``gpus`` as this process sees them (its CUDA_VISIBLE_DEVICES), None under MIG."""
    return cuda_order(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def trainer_capacity(gpus: list[Gpu], trainer: tuple[int, ...],
                     others: tuple[int, ...] = ()) -> tuple[float, str]:
    """(bytes free on the fullest of the ``trainer`` GPUs (indices into ``gpus``), what to say
    of the GPUs of the run, ``others`` included (its servers'), that other processes use)."""
    known = [i for i in trainer if i < len(gpus)]
    capacity = min(gpus[i].total - gpus[i].used for i in known)
    busy = [f"GPU {i}: {gpus[i].used / GiB:.1f} of {gpus[i].total / GiB:.1f} GiB"
            for i in sorted(set(known) | {i for i in others if i < len(gpus)})
            if gpus[i].used >= BUSY_BYTES]
    said = ("in use by other processes (nvidia-smi): " + ", ".join(busy)) if busy else ""
    return capacity, said
