"""The decode step's matmuls one by one (one GPU): each projection of the Qwen2-1.5B shape at the
loop's row count, its time, TFLOP/s and output tiles, under each matmul backend at hand.

    python benchmarks/decode_gemm.py                     # 512 rows: cuBLAS, cuBLASLt
    python benchmarks/decode_gemm.py --rows 512 1024 --autotune
    python benchmarks/decode_gemm.py --cpu               # a smoke run (tiny shapes, CPU)

Why: after the rotary/KV-write kernel, the network step at 512 rows is almost only matmuls
(3.46 ms, about 460 TFLOP/s on 1.6 TFLOP) and attention (2.9 ms, at the copy bandwidth)
(BENCHMARKS.md, "Decode step per kernel"). At 512 rows several projections have few output
tiles for the GPU's SMs (the down projection: 4 x 12 tiles of 128 x 128 on 132 SMs), so their
rate, not the total FLOPs, sets the step. Each row here: one projection (``F.linear`` of
[rows, K] by [N, K], a bias where the model has one), timed as a CUDA graph of 20 calls, best of
5; the step's share (x layers); the tile count against the SM count. Backends: torch's default
(cuBLAS), cuBLASLt (``torch.backends.cuda.preferred_blas_library``), and with ``--autotune``
inductor's max-autotune (Triton GEMM templates, autotuned per shape; minutes). ``gate+up`` is
the gate and up projections as one matmul of twice the width. The last table sums each
backend's step (one layer's projections x layers + the lm_head) and names the fastest per
projection.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _table import print_markdown_table  # noqa: E402
from decode_attention import timed  # noqa: E402 - a CUDA graph of n calls, best of 5 replays
from rollout import QWEN2_1_5B  # noqa: E402 - benchmarks/rollout.py


def projections(shape: dict) -> list[tuple[str, int, int, bool, int]]:
    """(name, N, K, bias, times per step) of the decode step's matmuls."""
    H, inter, layers = shape["hidden_size"], shape["intermediate_size"], \
        shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    D = shape.get("head_dim") or H // heads
    return [("qkv (fused)", (heads + 2 * kv) * D, H, True, layers),
            ("o", H, heads * D, False, layers),
            ("gate", inter, H, False, layers), ("up", inter, H, False, layers),
            ("gate+up (one matmul)", 2 * inter, H, False, 0),
            ("down", H, inter, False, layers),
            ("lm_head", shape["vocab_size"], H, False, 1)]


def backends(autotune: bool) -> list[tuple[str, object, object]]:
    """(name, the function, a context setter) per backend available here."""
    out = [("cublas", F.linear, "cublas")]
    if hasattr(torch.backends.cuda, "preferred_blas_library"):
        out.append(("cublaslt", F.linear, "cublaslt"))
    if autotune:
        compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        out.append(("inductor max-autotune", compiled, "cublas"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512])
    p.add_argument("--autotune", action="store_true",
                   help="also inductor's max-autotune GEMMs (autotunes each shape: minutes)")
    p.add_argument("--cpu", action="store_true", help="a smoke run: tiny shapes on CPU")
    args = p.parse_args()
    shape = dict(QWEN2_1_5B)
    if args.cpu:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        args.rows = [4]
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    sms = torch.cuda.get_device_properties(device).multi_processor_count if not args.cpu else 0
    if not args.cpu:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {sms} SMs")
    g = torch.Generator(device=device).manual_seed(0)
    rows_out, totals = [], []
    for rows in args.rows:
        step = {}
        for name, N, K, bias, per_step in projections(shape):
            x = torch.randn(rows, K, device=device, dtype=dtype, generator=g)
            w = torch.randn(N, K, device=device, dtype=dtype, generator=g) * K ** -0.5
            b = torch.randn(N, device=device, dtype=dtype, generator=g) if bias else None
            row = {"rows": rows, "projection": f"{name}: N {N}, K {K}",
                   "per step": per_step or "(instead of gate, up)",
                   "tiles 128x128": f"{-(-rows // 128) * -(-N // 128)}" + (f" on {sms} SMs"
                                                                          if sms else "")}
            if args.cpu:
                F.linear(x, w, b)
                row["cublas µs"] = "ran"
            else:
                for backend, fn, library in backends(args.autotune):
                    if hasattr(torch.backends.cuda, "preferred_blas_library"):
                        torch.backends.cuda.preferred_blas_library(library)
                    try:
                        us = timed(lambda: fn(x, w, b), 20)  # noqa: B023 - used at once
                    except Exception as exc:  # noqa: BLE001 - a backend that cannot run here
                        row[f"{backend} µs"] = f"failed: {type(exc).__name__}"
                        continue
                    tflops = 2 * rows * N * K / us / 1e6
                    row[f"{backend} µs"] = round(us, 1)
                    row[f"{backend} TFLOP/s"] = round(tflops)
                    step.setdefault(backend, {})[name] = (us, per_step)
                if hasattr(torch.backends.cuda, "preferred_blas_library"):
                    torch.backends.cuda.preferred_blas_library("cublas")
            print(row, flush=True)
            rows_out.append(row)
        for backend, times in step.items():
            ms = sum(us * n for us, n in times.values()) / 1e3
            fused = ms + (times["gate+up (one matmul)"][0] - times["gate"][0]
                          - times["up"][0]) * shape["num_hidden_layers"] / 1e3 \
                if "gate+up (one matmul)" in times else None
            totals.append({"rows": rows, "backend": backend, "matmuls ms per step": round(ms, 3),
                           "with gate+up as one": round(fused, 3) if fused else ""})
        if step:  # the fastest backend per projection, and that step
            names = [n for n, *_ in projections(shape) if n != "gate+up (one matmul)"]
            best = {n: min(step, key=lambda bk: step[bk].get(n, (float("inf"),))[0])
                    for n in names}
            ms = sum(step[best[n]][n][0] * step[best[n]][n][1] for n in names) / 1e3
            totals.append({"rows": rows, "backend": "fastest per projection: " + ", ".join(
                f"{n} {bk}" for n, bk in best.items()), "matmuls ms per step": round(ms, 3)})
    print_markdown_table(rows_out, ("rows", "projection", "per step", "tiles 128x128"))
    if totals:
        print("\n# the step's matmuls per backend (projections x layers + lm_head)")
        print_markdown_table(totals, ("rows", "backend", "matmuls ms per step"))


if __name__ == "__main__":
    main()
