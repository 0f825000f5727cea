"""The decode step's attention alone (one GPU): torch's flash forward (``attention="flash"``)
against fsdpfn's split-KV Triton kernel (``attention="triton"``, fsdpfn/rollout/attention_kernel.py)
in several tile settings, on one layer's slot cache of the Qwen2-1.5B shape.

    python benchmarks/decode_attention.py                  # 512 and 1,024 rows, bf16
    python benchmarks/decode_attention.py --rows 512 --equal 512   # the loop's case

Each row sits at a random position in [--min-pos, --max-len), or with --equal OWN every row at
--min-pos + OWN (the decode loop's rows start together): the cache positions a step reads are
the rows' lengths summed. The "shared prompts" rows group the rows by --samples (the samples of
one prompt, as the decode loop runs them) whose caches begin with the same --min-pos positions
(``shared=``), each row reading them from its group's first row's cache, the same addresses for
the whole group (read from HBM about once); their GB/s counts the bytes the rows attend, as the
other rows do, so it can pass the copy bandwidth. Per setting: microseconds per call (a CUDA
graph of --iters calls, replayed), the KV bytes read over that time (GB/s; the copy bandwidth of
the same run is the ceiling), and the largest gap to the flash output. The step runs this 28
times (one per layer).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from decode_step import capture  # noqa: E402 - benchmarks/decode_step.py
from rollout import copy_bandwidth  # noqa: E402 - benchmarks/rollout.py

from fsdpfn.rollout import attention_kernel  # noqa: E402
from fsdpfn.rollout.slot_model import _flash_decode  # noqa: E402

SETTINGS = [  # (name, keyword arguments of attention_kernel.decode)
    ("triton (default)", {}),
    ("triton, block 32", dict(block_n=32)),
    ("triton, block 128", dict(block_n=128)),
    ("triton, 8 warps", dict(num_warps=8)),
    ("triton, 3 stages", dict(num_stages=3)),
    ("triton, 4 splits", dict(splits=4)),
    ("triton, 128 block, 8 warps, 3 stages", dict(block_n=128, num_warps=8, num_stages=3)),
]


SHARED_SETTINGS = [  # the kernel's knobs with shared prompts
    {}, dict(block_n=64), dict(num_warps=8), dict(num_stages=3), dict(splits=2)]


def timed(fn, iters: int, flush=None) -> float:
    """Microseconds per call of fn, from a CUDA graph of iters calls (best of 5 replays).
    ``flush``: a buffer written before each call (evicting L2, as the step's matmuls do between
    two layers' attention), its own time subtracted."""
    if flush is not None:
        return timed(lambda: (flush.zero_(), fn()), iters) - timed(flush.zero_, iters)
    graph = capture(fn, iters)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / iters)
    return best


def slot_cache(R: int, heads: int, kv: int, D: int, max_len: int, shared_len: int,
               samples: int, g):
    """Random bf16 queries q [R, heads, D] and a slot cache k, v [R, kv, max_len, D] whose rows
    come in groups of ``samples`` holding the same first ``shared_len`` positions (the decode
    loop copies a prompt's KV to its samples' slots), and the groups' share_tables."""
    q = torch.randn(R, heads, D, generator=g, device="cuda").to(torch.bfloat16)
    k, v = torch.randn(2, R, kv, max_len, D, generator=g, device="cuda").to(torch.bfloat16)
    groups = [(shared_len, list(range(s, min(R, s + samples)))) for s in range(0, R, samples)]
    for length, ids in groups:
        k[ids[1:], :, :length], v[ids[1:], :, :length] = k[ids[0], :, :length], \
            v[ids[0], :, :length]
    return q, k, v, attention_kernel.share_tables(groups, R, "cuda")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--max-len", type=int, default=1280)
    p.add_argument("--min-pos", type=int, default=256)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--samples", type=int, default=8, help="rows per prompt (shared prompts)")
    p.add_argument("--equal", type=int, default=None, metavar="OWN",
                   help="every row at --min-pos + OWN positions (the decode loop's case: its rows "
                        "start together) instead of at random positions")
    p.add_argument("--kernels", nargs="*", default=None,
                   help="only the settings whose name holds one of these, or ends with one "
                        "written with a final $ (flash always runs)")
    p.add_argument("--flush", type=int, default=0, metavar="MB",
                   help="write a buffer of MB megabytes before each call (L2 evicted), its time "
                        "subtracted")
    args = p.parse_args()
    flush = torch.empty(args.flush << 20, dtype=torch.uint8, device="cuda") if args.flush \
        else None
    kv, heads, D = 2, 12, 128
    bandwidth = copy_bandwidth()
    table = []
    for R in args.rows:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, shared = slot_cache(R, heads, kv, D, args.max_len, args.min_pos, args.samples, g)
        pos = torch.randint(args.min_pos, args.max_len, (R,), generator=g, device="cuda")
        if args.equal is not None:  # the loop's rows, started together
            pos = torch.full((R,), args.min_pos + args.equal - 1, device="cuda")
        used = (pos + 1).to(torch.int32)
        nbytes = 2 * int(used.sum()) * kv * D * 2
        seqs = torch.arange(R * kv + 1, dtype=torch.int32, device="cuda")
        cu_q, cu_k = seqs * (heads // kv), seqs * args.max_len
        used_kv = used.repeat_interleave(kv)
        scale = D ** -0.5
        runs = [("flash", lambda: _flash_decode(q, k, v, cu_q, cu_k, used_kv, args.max_len,
                                                 scale))]
        runs += [(name, lambda kw=kw: attention_kernel.decode(q, k, v, used, args.max_len, scale,
                                                              **kw))
                 for name, kw in SETTINGS]
        name = f"triton, shared prompts ({args.samples} rows, {args.min_pos} positions)"
        runs += [(name + (f", {kw}" if kw else ""),
                  lambda kw=kw: attention_kernel.decode(q, k, v, used, args.max_len, scale,
                                                        shared=shared, **kw))
                 for kw in SHARED_SETTINGS]
        if args.kernels:
            runs = runs[:1] + [r for r in runs[1:] if any(
                r[0].endswith(w[:-1]) if w.endswith("$") else w in r[0] for w in args.kernels)]
        ref = runs[0][1]().float()
        for name, fn in runs:
            try:
                gap = float((fn().float() - ref).abs().max())
                us = timed(fn, args.iters, flush)
            except Exception as e:  # a setting that does not compile here: say so, go on
                table.append({"rows": R, "kernel": name, "us / call": "failed",
                              "KV GB/s": f"{type(e).__name__}: {str(e)[:80]}"})
                continue
            table.append({"rows": R, "kernel": name, "us / call": f"{us:.1f}",
                          "KV GB/s": f"{nbytes / us / 1e3:.0f}", "max |Δ| to flash": f"{gap:.4f}",
                          "28 layers ms": f"{28 * us / 1e3:.2f}"})
    print(f"copy bandwidth (read + write): {bandwidth:.0f} GB/s")
    print_markdown_table(table, ("rows", "kernel"))


if __name__ == "__main__":
    main()
