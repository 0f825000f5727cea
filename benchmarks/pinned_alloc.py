"""Pinned host memory: seconds to reserve a block by each way of pinning, and the host-to-device
copy bandwidth from it (one GPU).

    python benchmarks/pinned_alloc.py                 # 16 GiB per way, each in a fresh process
    python benchmarks/pinned_alloc.py --gib 32 --threads 16

The per-layer optimizer reserves its whole pinned state when it is built (88.6 GB at 14B with the
bf16 state), and that reservation was the largest phase of the 14B build from safetensors
(BENCHMARKS.md, "Build time"). The ways:

- ``register``: torch's pinned allocator on its register path (``pinned_use_cuda_host_register``,
  the pages touched by several threads, then cudaHostRegister), the optimizer's way until now;
- ``mmap``: an anonymous mapping touched by torch's threads (one byte per 4 KiB page), then
  cudaHostRegister, with ``+huge``: the mapping advised MADV_HUGEPAGE first (2 MiB pages where
  the kernel's transparent huge pages allow it: fewer faults and fewer pages to pin).

Each way runs in its own process (the pinned allocator caches what it frees); the table gives
the reservation's seconds, its GB/s, whether torch sees the block as pinned, and a 1 GiB
non-blocking copy to the GPU from it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402 - benchmarks/ is this script's folder

WAYS = ("register", "mmap", "mmap+huge")


def _anon_huge_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


def _copy_gbs(block: torch.Tensor) -> float:
    n = 1 << 30
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(block[:n], non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return n / best / 1e9


def one(way: str, nbytes: int, threads: int) -> dict:
    torch.cuda.init()
    torch.set_num_threads(threads)
    huge_before = _anon_huge_kib()
    t = time.perf_counter()
    if way == "register":
        setting = (f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}")
        torch._C._accelerator_setAllocatorSettings(setting)  # noqa: SLF001
        block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        touched = t
    else:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if way.endswith("+huge"):
            m.madvise(mmap.MADV_HUGEPAGE)
        block = torch.frombuffer(m, dtype=torch.uint8)
        block.as_strided((nbytes // 4096,), (4096,)).fill_(0)
        touched = time.perf_counter()
        err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: {err}")
    seconds = time.perf_counter() - t
    return {"way": way, "GiB": nbytes >> 30, "threads": threads, "seconds": round(seconds, 2),
            "of which touching s": round(touched - t, 2) if way != "register" else "",
            "GB/s": round(nbytes / seconds / 1e9, 2), "pinned": bool(block.is_pinned()),
            "copy to GPU GB/s": round(_copy_gbs(block), 1),
            "huge pages GiB": round((_anon_huge_kib() - huge_before) / 2 ** 20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.gib << 30, args.threads)))
        return
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    print("transparent huge pages:", open(thp).read().strip() if os.path.exists(thp) else "n/a")
    rows = []
    for way in args.ways:
        out = subprocess.run([sys.executable, __file__, "--one", way, "--gib", str(args.gib),
                              "--threads", str(args.threads)], capture_output=True, text=True)
        if out.returncode:
            rows.append({"way": way, "seconds": f"failed: {out.stderr.strip()[-300:]}"})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    print_markdown_table(rows, ("way", "GiB", "seconds", "GB/s"))


if __name__ == "__main__":
    main()
