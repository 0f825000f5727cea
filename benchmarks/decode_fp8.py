"""Would FP8 matmuls bring the decode step to 4.8 ms? (one GPU; before building a path)

    python benchmarks/decode_fp8.py                  # 512 rows of the Qwen2-1.5B shape
    python benchmarks/decode_fp8.py --rows 512 1024

At 512 rows the server's step is about half matmuls (2.8 ms of the H200's 5.9 ms, BENCHMARKS.md,
"Decode overlap of attention and matmuls"), bound by the tensor cores' bf16 rate. Hopper's FP8
rate is twice that, and an FP8 weight is half the bytes. This times one step's projections
(28 layers of the shape, in one CUDA graph) as the server runs them in bf16 and as an FP8 path
would: weights quantized once per push to float8_e4m3 with one scale per output channel,
each matmul's input quantized per row on the fly, ``torch._scaled_mm`` with both scales and a
bf16 output. Rows of the table:

- ``bf16, as served``: q/k/v merged, o, gate and up apart, down (``F.linear``);
- ``bf16, gate and up merged``: the same with one gate/up matmul;
- ``fp8 matmuls alone``: the FP8 matmuls on inputs quantized beforehand (the bound);
- ``fp8, inputs quantized by torch ops``: abs, amax, divide and cast before each matmul;
- ``fp8, inputs quantized by one Triton kernel``: a row's amax and cast in one pass (what a
  fused norm or SwiGLU kernel would cost at least).

Also the error of each against a float64 product of the unquantized bf16 inputs and weights:
bf16's own rounding against FP8's. The sampled distribution of an FP8 server is its own (the
log-probs it returns are of what it sampled), but the trainer's recomputation in bf16 differs
by that error. Nothing in the server changes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from decode_attention import timed  # noqa: E402 - a CUDA graph of n calls, best of 5 replays
from rollout import QWEN2_1_5B  # noqa: E402 - benchmarks/rollout.py

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _quant_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quant_rows(x_ptr, q_ptr, s_ptr, K, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        tl.store(q_ptr + row * K + cols, (x / scale).to(q_ptr.dtype.element_ty), mask=cols < K)
        tl.store(s_ptr + row, scale)

    def quant(x, q, s):
        quant_rows[(x.shape[0],)](x, q, s, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
                                  num_warps=8)
        return q, s
    return quant


def quant_torch(x, q, s):
    s.copy_(x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX)
    q.copy_((x.float() / s).to(FP8))
    return q, s


def quant_weight(w):
    """(N, K) bf16 -> (K, N) column-major float8 and its (1, N) per-output-channel scale."""
    s = w.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (w.float() / s).to(FP8).t(), s.t().contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512])
    args = p.parse_args()
    shape = QWEN2_1_5B
    H, inter, layers = shape["hidden_size"], shape["intermediate_size"], \
        shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    D = H // heads
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, device=dev, dtype=torch.bfloat16, generator=g) * 0.02

    w = [{"qkv": rand((heads + 2 * kv) * D, H), "o": rand(H, H), "gate": rand(inter, H),
          "up": rand(inter, H), "down": rand(H, inter)} for _ in range(layers)]
    for lw in w:
        lw["gate_up"] = torch.cat([lw["gate"], lw["up"]])
    w8 = [{k: quant_weight(lw[k]) for k in ("qkv", "o", "gate_up", "down")} for lw in w]
    quant_triton = _quant_kernel()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: the projections of "
          f"{layers} layers of the Qwen2-1.5B shape, one CUDA graph")
    table = []
    for rows in args.rows:
        x, xo, xd = rand(rows, H), rand(rows, H), rand(rows, inter)  # of qkv/gate_up, o, down
        bufs = {K: (torch.empty(rows, K, device=dev, dtype=FP8),
                    torch.empty(rows, 1, device=dev, dtype=torch.float32)) for K in (H, inter)}
        pre = {name: quant_torch(t, torch.empty_like(t, dtype=FP8),
                                 torch.empty(rows, 1, device=dev))
               for name, t in (("x", x), ("xo", xo), ("xd", xd))}

        def bf16_served():
            for lw in w:
                F.linear(x, lw["qkv"]), F.linear(xo, lw["o"])
                F.linear(x, lw["gate"]), F.linear(x, lw["up"]), F.linear(xd, lw["down"])

        def bf16_merged():
            for lw in w:
                F.linear(x, lw["qkv"]), F.linear(xo, lw["o"])
                F.linear(x, lw["gate_up"]), F.linear(xd, lw["down"])

        def mm8(a, wq):
            return torch._scaled_mm(a[0], wq[0], scale_a=a[1], scale_b=wq[1],
                                    out_dtype=torch.bfloat16)

        def fp8(quant):
            def run():
                for lw in w8:
                    a = pre["x"] if quant is None else quant(x, *bufs[H])
                    mm8(a, lw["qkv"])
                    mm8(pre["xo"] if quant is None else quant(xo, *bufs[H]), lw["o"])
                    a = pre["x"] if quant is None else quant(x, *bufs[H])
                    mm8(a, lw["gate_up"])
                    mm8(pre["xd"] if quant is None else quant(xd, *bufs[inter]), lw["down"])
            return run

        def err(name, inp, out):  # max |out - ref| / max |ref| of layer 0's projection
            ref = inp.double() @ w[0][name].double().t()
            return ((out.double() - ref).abs().max() / ref.abs().max()).item()

        with torch.no_grad():
            e16 = max(err(k, i, F.linear(i, w[0][k])) for k, i in
                      (("qkv", x), ("o", xo), ("gate_up", x), ("down", xd)))
            e8 = max(err(k, i, mm8(quant_torch(i, torch.empty_like(i, dtype=FP8),
                                              torch.empty(rows, 1, device=dev)), w8[0][k]))
                     for k, i in (("qkv", x), ("o", xo), ("gate_up", x), ("down", xd)))
            for name, fn, e in (("bf16, as served", bf16_served, e16),
                                ("bf16, gate and up merged", bf16_merged, e16),
                                ("fp8 matmuls alone", fp8(None), e8),
                                ("fp8, inputs quantized by torch ops", fp8(quant_torch), e8),
                                ("fp8, inputs quantized by one Triton kernel",
                                 fp8(quant_triton), e8)):
                ms = timed(fn, 1) / 1e3
                table.append({"rows": rows, "matmuls": name, "ms a step": round(ms, 3),
                              "max rel. error vs float64": f"{e:.1e}"})
    print_markdown_table(table, ("rows", "matmuls"))


if __name__ == "__main__":
    main()
