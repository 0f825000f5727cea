"""The content checksum's speed against the alternatives, on the CPU and on a CUDA device.

    python benchmarks/checksum.py            # CPU rows always; CUDA rows when a GPU is present
    python benchmarks/checksum.py --mb 256   # bytes per measured tensor (default 256 MB)

Rows: fsdpfn.wire.checksum on a 2-D bf16 weight (a checkpoint chunk: the float64 product path),
on a sub-box of it (a load at another world size), a push's flat bucket (the fused Triton pass
on CUDA), and for reference a plain copy, zlib.crc32 of the same bytes on the host (plus, from a
GPU, the copy to the host it would need), and xxhash's 64-bit hash where installed. Prints one
Markdown table: median milliseconds of 5 runs and GB/s of the tensor's bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from fsdpfn.wire import checksum  # noqa: E402
from fsdpfn.wire.protocol import flat_checksums  # noqa: E402


def timed(fn, device: str, reps: int = 5) -> float:
    """Median milliseconds of ``reps`` calls after one warm-up, synchronised on CUDA."""
    fn()
    out = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def rows_for(device: str, mb: int) -> list[dict]:
    cols = 1536
    n_rows = mb * (1 << 20) // (2 * cols)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_rows, cols, generator=g).to(torch.bfloat16).to(device)
    nbytes = w.numel() * 2
    buf = w.view(-1).view(torch.uint8)[: nbytes // 4096 * 4096]
    offsets, sizes = [0], [buf.numel()]
    host = w.view(-1).view(torch.uint8).cpu().numpy()
    cases = [
        ("checksum: 2-D bf16 chunk", lambda: checksum.box_hash(w)),
        ("checksum: a sub-box (rows 1/4..3/4, cols 7..1500)",
         lambda: checksum.box_hash(w[n_rows // 4: 3 * n_rows // 4, 7:1500], w.shape,
                                   [n_rows // 4, 7])),
        ("checksum: flat bucket (push)", lambda: flat_checksums(buf, offsets, sizes)),
        ("copy (reference: read + write)", lambda: w.clone()),
        ("zlib.crc32 of the host bytes", lambda: zlib.crc32(host)),
    ]
    if device == "cuda":
        cases.append(("copy to the host (what a host CRC needs)", lambda: w.cpu()))
    try:
        import xxhash

        cases.append(("xxhash.xxh64 of the host bytes", lambda: xxhash.xxh64(host).digest()))
    except ImportError:
        pass
    out = []
    for name, fn in cases:
        ms = timed(fn, device)
        out.append({"device": device, "operation": name, "ms": round(ms, 2),
                    "GB/s": round(nbytes / ms / 1e6, 1)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = [row for device in devices for row in rows_for(device, args.mb)]
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"# {args.mb} MB of bf16; CPU threads {torch.get_num_threads()}; {name}")
    print_markdown_table(rows, ("device", "operation"))


if __name__ == "__main__":
    main()
