"""The decode step's narrow matmuls against Triton tilings of our own (one GPU): can a tiling
with more output tiles than cuBLAS's fill the 132 SMs where cuBLAS leaves them idle?

    python benchmarks/decode_gemm_triton.py               # 512 rows of the Qwen2-1.5B shape
    python benchmarks/decode_gemm_triton.py --cpu         # a smoke run under Triton's interpreter

Why: at 512 rows the q/k/v, o and down projections have N of 1,536 to 2,048, so 128 x 128
output tiles number 48 to 64 on 132 SMs, and cuBLAS runs them at 384 to 533 TFLOP/s against
690 for gate and up (BENCHMARKS.md, "Decode matmuls per backend"). Brought to gate's rate they
would take about 0.3 ms off a 5.9 ms step. Each row here times one projection (``x @ w.T`` plus
its bias) as a CUDA graph of 20 calls, best of 5, under cuBLAS and under a Triton kernel at each
tiling of a sweep (BM x BN x BK, stages, warps, and for the long-K down projection a split of K
whose float32 parts a second kernel sums in a fixed order). Its error column is the largest
|Δ| against a float64 product, beside cuBLAS's own (a tiling sums K in another order, so its
bits differ; this says whether they differ by more than rounding).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _table import print_markdown_table  # noqa: E402
from decode_gemm import projections as all_projections  # noqa: E402 - each (name, N, K, ...)
from rollout import QWEN2_1_5B  # noqa: E402 - benchmarks/rollout.py

NARROW = ("qkv (fused)", "o", "down", "gate")  # the narrow three, and gate as the wide yardstick


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm_kernel(a, w, bias, out, M, N, K, K_PER, s_am, s_wn, s_om, s_op,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    HAS_BIAS: tl.constexpr, PARTS: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        part = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        k0 = part * K_PER
        a_ptr = a + rm[:, None].to(tl.int64) * s_am + (k0 + rk)[None, :]
        w_ptr = w + rn[None, :].to(tl.int64) * s_wn + (k0 + rk)[:, None]
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(0, K_PER, BK):
            at = tl.load(a_ptr, mask=(rm[:, None] < M) & ((k0 + k + rk)[None, :] < K),
                         other=0.0)
            wt = tl.load(w_ptr, mask=(rn[None, :] < N) & ((k0 + k + rk)[:, None] < K),
                         other=0.0)
            acc = tl.dot(at, wt, acc)
            a_ptr += BK
            w_ptr += BK
        live = (rm[:, None] < M) & (rn[None, :] < N)
        if PARTS == 1:
            if HAS_BIAS:
                acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out + rm[:, None].to(tl.int64) * s_om + rn[None, :],
                     acc.to(out.dtype.element_ty), mask=live)
        else:  # float32 parts [PARTS, M, N], summed by sum_kernel in a fixed order
            tl.store(out + part * s_op + rm[:, None].to(tl.int64) * N + rn[None, :], acc,
                     mask=live)

    @triton.jit
    def sum_kernel(parts, bias, out, MN, N, s_op, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < MN
        acc = tl.load(parts + i, mask=live, other=0.0)
        for p in tl.static_range(1, PARTS):
            acc += tl.load(parts + p * s_op + i, mask=live, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias + i % N, mask=live, other=0.0).to(tl.float32)
        tl.store(out + i, acc.to(out.dtype.element_ty), mask=live)

    return gemm_kernel, sum_kernel


def triton_linear(x, w, b, bm, bn, bk, stages, warps, parts=1):
    """x [M, K] @ w[N, K].T (+ b) at one tiling; ``parts`` > 1 splits K into that many ranges."""
    gemm_kernel, sum_kernel = _kernels()
    M, K = x.shape
    N = w.shape[0]
    k_per = -(-K // parts)
    k_per = -(-k_per // bk) * bk
    parts = -(-K // k_per)
    grid = (-(-M // bm), -(-N // bn), parts)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if parts == 1:
        gemm_kernel[grid](x, w, b if b is not None else x, out, M, N, K, k_per, x.stride(0),
                          w.stride(0), out.stride(0), 0, BM=bm, BN=bn, BK=bk,
                          HAS_BIAS=b is not None, PARTS=1, num_stages=stages, num_warps=warps)
        return out
    work = torch.empty(parts, M, N, dtype=torch.float32, device=x.device)
    gemm_kernel[grid](x, w, x, work, M, N, K, k_per, x.stride(0), w.stride(0), 0, M * N,
                      BM=bm, BN=bn, BK=bk, HAS_BIAS=False, PARTS=parts, num_stages=stages,
                      num_warps=warps)
    block = 1024
    sum_kernel[(-(-M * N // block),)](work, b if b is not None else x, out, M * N, N, M * N,
                                      PARTS=parts, HAS_BIAS=b is not None, BLOCK=block)
    return out


def tilings(K: int, cpu: bool) -> list[tuple]:
    """(BM, BN, BK, stages, warps, parts) to sweep."""
    if cpu:
        return [(16, 16, 16, 1, 4, 1), (16, 32, 16, 1, 4, 2)]
    out = []
    for bm, bn in ((128, 128), (128, 64), (64, 128), (64, 64), (64, 256), (128, 256)):
        for bk, stages in ((64, 3), (64, 4), (64, 5), (128, 3)):
            for warps in ((4, 8) if bm * bn >= 128 * 128 else (4,)):
                out.append((bm, bn, bk, stages, warps, 1))
    if K >= 4096:
        for parts in (2, 3, 4):
            for bm, bn in ((128, 128), (128, 64)):
                out.append((bm, bn, 64, 4, 8 if bn == 128 else 4, parts))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--cpu", action="store_true", help="a smoke run under Triton's interpreter")
    p.add_argument("--only", nargs="*", default=None, help="projections by name")
    args = p.parse_args()
    shape = dict(QWEN2_1_5B)
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        shape.update(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=1, num_hidden_layers=2, vocab_size=64)
        args.rows = 8
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    projections = [(name, N, K, bias) for name, N, K, bias, _ in all_projections(shape)
                   if name in NARROW and (not args.only or name in args.only)]
    g = torch.Generator(device=device).manual_seed(0)
    if not args.cpu:
        from decode_attention import timed  # a CUDA graph of n calls, best of 5 replays

        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs", flush=True)
    table, best_rows = [], []
    for name, N, K, bias in projections:
        x = torch.randn(args.rows, K, device=device, dtype=dtype, generator=g)
        w = torch.randn(N, K, device=device, dtype=dtype, generator=g) * K ** -0.5
        b = torch.randn(N, device=device, dtype=dtype, generator=g) if bias else None
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        flop = 2 * args.rows * N * K
        base = torch.nn.functional.linear(x, w, b)
        base_err = (base.double() - ref).abs().max().item()
        us_base = timed(lambda: torch.nn.functional.linear(x, w, b), 20) if not args.cpu \
            else float("nan")
        print(f"{name}: N {N}, K {K}: cuBLAS {us_base:.2f} µs "
              f"({flop / us_base / 1e6:.0f} TFLOP/s), err {base_err:.3g}", flush=True)
        results = []
        for cfg in tilings(K, args.cpu):
            bm, bn, bk, stages, warps, parts = cfg
            try:
                y = triton_linear(x, w, b, *cfg)
                err = (y.double() - ref).abs().max().item()
                us = timed(lambda: triton_linear(x, w, b, *cfg), 20) \
                    if not args.cpu else float("nan")  # noqa: B023 - used at once
            except Exception as exc:  # noqa: BLE001 - a tiling this GPU cannot hold
                print(f"  {cfg}: failed {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            row = {"projection": name, "tiling BMxBNxBK/stages/warps/parts":
                   f"{bm}x{bn}x{bk}/{stages}/{warps}/{parts}",
                   "tiles": -(-args.rows // bm) * -(-N // bn) * parts,
                   "µs": round(us, 2), "TFLOP/s": round(flop / us / 1e6) if us == us else "",
                   "cuBLAS µs": round(us_base, 2), "max |Δ| vs f64": f"{err:.3g}",
                   "cuBLAS's": f"{base_err:.3g}"}
            print("  ", row, flush=True)
            results.append(row)
        table += results
        if results:
            best_rows.append(min(results, key=lambda r: r["µs"] if r["µs"] == r["µs"] else 0))
    print_markdown_table(table, ("projection", "tiling BMxBNxBK/stages/warps/parts"))
    print("\n# the best tiling per projection")
    print_markdown_table(best_rows, ("projection", "tiling BMxBNxBK/stages/warps/parts"))


if __name__ == "__main__":
    main()
