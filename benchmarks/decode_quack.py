"""The decode step's matmuls under quack's CuTe-DSL GEMMs against cuBLAS (one H100/H200 GPU).

    python benchmarks/decode_quack.py            # 512 rows of the Qwen2-1.5B shape

quack (``quack-kernels``, CuTe DSL: TMA loads, warp-specialised wgmma, persistent tile
schedulers, split-K) offers what Triton's matmul could not reach on the H200 (BENCHMARKS.md,
"Decode matmuls per backend"), and a gated epilogue: gate and up as one GEMM whose epilogue
applies SiLU(gate)·up from the float32 accumulators, so the two [R, 8,960] products are never
written. Rows:

- ``gate+up+swiglu``: the server's path (two cuBLAS matmuls, Liger's SiLU·mul kernel) against
  ``quack.gemm_interface.gemm_act(..., activation="swiglu", store_preact=False)`` on the two
  weights interleaved (gate row i, then up row i);
- ``qkv``, ``o``, ``down``: ``F.linear`` against ``quack.gemm_interface.gemm`` (its default
  config, then autotuned).

Each is a CUDA graph of 20 calls, best of 5; the error is the largest |Δ| against a float64
reference of HF's formula (for SwiGLU: gate and up rounded to the model's dtype first, as the
served model computes them), beside the server path's own.

quack is not a dependency of fsdpfn, and ../shared/device/wheels.sh does not fetch it. What the
measurement used (about 100 MB, with the CuTe DSL's compiler in nvidia-cutlass-dsl-libs-cu13):
quack-kernels 0.6.5, nvidia-cutlass-dsl 4.8.1 with its libs-core, libs-base and libs-cu13,
apache-tvm-ffi, torch-c-dlpack-ext and einops, unpacked into one directory on PYTHONPATH
together with its ``nvidia_cutlass_dsl/dsl_packages`` (the package's .pth file is not read
from PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _table import print_markdown_table  # noqa: E402
from decode_attention import timed  # noqa: E402 - a CUDA graph of n calls, best of 5 replays
from decode_gemm import projections  # noqa: E402 - each (name, N, K, bias, per step)
from rollout import QWEN2_1_5B  # noqa: E402 - benchmarks/rollout.py


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--no-tune", action="store_true", help="only quack's default configs")
    args = p.parse_args()
    import quack
    from quack import gemm_interface as qg

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, quack "
          f"{getattr(quack, '__version__', '?')}", flush=True)
    shape = QWEN2_1_5B
    H, inter = shape["hidden_size"], shape["intermediate_size"]
    R = args.rows
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*size, scale=1.0):
        return torch.randn(*size, device=dev, dtype=dt, generator=g) * scale

    rows = []

    def record(name, variant, fn, ref, flop):
        try:
            y = fn()
            err = (y.double() - ref).abs().max().item()
            us = timed(fn, 20)
        except Exception as exc:  # noqa: BLE001 - a variant this GPU or version cannot run
            traceback.print_exc()
            rows.append({"projection": name, "variant": variant,
                         "µs": f"failed: {type(exc).__name__}: {str(exc)[:80]}"})
            print(rows[-1], flush=True)
            return
        rows.append({"projection": name, "variant": variant, "µs": round(us, 2),
                     "TFLOP/s": round(flop / us / 1e6), "max |Δ| vs f64": f"{err:.3g}"})
        print(rows[-1], flush=True)

    # gate + up + SwiGLU
    x = rand(R, H)
    wg, wu = rand(inter, H, scale=H ** -0.5), rand(inter, H, scale=H ** -0.5)
    gr, ur = F.linear(x, wg), F.linear(x, wu)  # the served model's bf16 gate and up
    ref = F.silu(gr.double()) * ur.double()
    flop = 2 * R * 2 * inter * H
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def server_mlp():
        return LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu))

    record("gate+up+swiglu", "cuBLAS x2 + Liger SiLU·mul (the server's)", server_mlp, ref,
           flop)
    w_int = torch.stack([wg, wu], 1).reshape(2 * inter, H)  # rows g0, u0, g1, u1, ...
    post = torch.empty(R, inter, device=dev, dtype=dt)
    for tuned in ([False] if args.no_tune else [False, True]):
        def quack_mlp(tuned=tuned):
            return qg.gemm_act(x, w_int.T, activation="swiglu", postact_out=post,
                               store_preact=False, tuned=tuned)[1]
        record("gate+up+swiglu", f"quack gemm_act swiglu ({'tuned' if tuned else 'default'})",
               quack_mlp, ref, flop)
    # the narrow projections
    for name, N, K, bias, _ in projections(shape):
        if name not in ("qkv (fused)", "o", "down", "gate"):
            continue
        a = rand(R, K)
        w = rand(N, K, scale=K ** -0.5)
        b = rand(N) if bias else None
        ref = a.double() @ w.double().T + (b.double() if bias else 0)
        flop = 2 * R * N * K
        record(name, "cuBLAS (F.linear)", lambda a=a, w=w, b=b: F.linear(a, w, b), ref, flop)
        out = torch.empty(R, N, device=dev, dtype=dt)
        for tuned in ([False] if args.no_tune or name == "gate" else [False, True]):
            record(name, f"quack gemm ({'tuned' if tuned else 'default'})",
                   lambda a=a, w=w, b=b, tuned=tuned: qg.gemm(a, w.T, out=out, bias=b,
                                                             tuned=tuned), ref, flop)
        for split in ((2, 4) if K >= 4096 else ()):  # K in parts, summed in a fixed order
            record(name, f"quack gemm, split_k {split} (serial)",
                   lambda a=a, w=w, split=split: qg.gemm(a, w.T, out=out, tuned=False,
                                                         split_k=split), ref, flop)
    print_markdown_table(rows, ("projection", "variant"))


if __name__ == "__main__":
    main()
