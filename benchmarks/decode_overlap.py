"""Can the decode step overlap its attention with its matmuls? (one GPU; before building it)

    python benchmarks/decode_overlap.py                  # 512 rows of the Qwen2-1.5B shape
    python benchmarks/decode_overlap.py --cpu            # a smoke run (tiny shapes, no streams)

After the rotary/KV-write kernel, the step at 512 rows is almost only matmuls (compute-bound,
about 3.5 ms) and attention over the KV cache (bandwidth-bound, about 2.9 ms), one after the
other (BENCHMARKS.md, "Decode step per kernel"). If the two ran at once on one GPU, the step
would approach the longer of them. This measures, for one layer of the shape, as CUDA graphs of
``--layers`` repetitions:

- ``attention``: fsdpfn's split-KV Triton attention over all rows (contexts in [256, 1280));
- ``matmuls``: the layer's projections over all rows (q/k/v, o, gate, up, down);
- ``sequential halves``: both, rows split in two halves, half A then half B (what a two-batch
  step would cost with no overlap; the smaller matmuls' lost efficiency shows here);
- ``two streams``: half A on one stream (attention, then matmuls), half B on another (matmuls,
  then attention), so that one half's attention can run beside the other half's matmuls.

A ``two streams`` time well under ``attention + matmuls`` says overlap pays and by how much a
step would shrink (x layers); near it, the GPU cannot run the two side by side and the idea is
dropped. Nothing here changes what the server computes.
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


def layer_parts(shape: dict, rows: int, max_len: int, device, dtype, g):
    """Weights, inputs and a KV cache for one layer at ``rows`` rows."""
    H, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    D = H // heads

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=g) * 0.02

    weights = {"qkv": rand((heads + 2 * kv) * D, H), "o": rand(H, heads * D),
               "gate": rand(inter, H), "up": rand(inter, H), "down": rand(H, inter)}
    cache = (rand(rows, kv, max_len, D), rand(rows, kv, max_len, D))
    q = rand(rows, heads, D)
    x = rand(rows, H)
    used = torch.randint(256, max_len, (rows,), device=device, generator=g, dtype=torch.int32)
    return weights, cache, q, x, used, D


def matmuls(weights, x):
    y = F.linear(x, weights["qkv"])
    y = F.linear(x, weights["o"])
    h = F.silu(F.linear(x, weights["gate"])) * F.linear(x, weights["up"])
    return y, F.linear(h, weights["down"])


def attention(q, cache, used, max_len, D, device):
    if device.type == "cuda":
        from fsdpfn.rollout import attention_kernel

        return attention_kernel.decode(q, cache[0], cache[1], used, max_len, D ** -0.5)
    k = cache[0].repeat_interleave(q.shape[1] // cache[0].shape[1], 1)
    v = cache[1].repeat_interleave(q.shape[1] // cache[1].shape[1], 1)
    return F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--max-len", type=int, default=1280)
    p.add_argument("--layers", type=int, default=8, help="repetitions in one graph")
    p.add_argument("--cpu", action="store_true", help="a smoke run: tiny shapes on CPU")
    args = p.parse_args()
    shape = dict(QWEN2_1_5B)
    if args.cpu:
        shape.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2)
        args.rows, args.max_len, args.layers = 8, 300, 1
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    weights, cache, q, x, used, D = layer_parts(shape, args.rows, args.max_len, device, dtype, g)
    half = args.rows // 2
    halves = [(q[s], (cache[0][s], cache[1][s]), x[s], used[s])
              for s in (slice(0, half), slice(half, args.rows))]

    def run_attention():
        for _ in range(args.layers):
            attention(q, cache, used, args.max_len, D, device)

    def run_matmuls():
        for _ in range(args.layers):
            matmuls(weights, x)

    def run_sequential():
        for _ in range(args.layers):
            for hq, hc, hx, hu in halves:
                attention(hq, hc, hu, args.max_len, D, device)
                matmuls(weights, hx)

    def run_streams():
        streams = (torch.cuda.Stream(), torch.cuda.Stream())
        here = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(here)
        (aq, ac, ax, au), (bq, bc, bx, bu) = halves
        with torch.cuda.stream(streams[0]):
            for _ in range(args.layers):
                attention(aq, ac, au, args.max_len, D, device)
                matmuls(weights, ax)
        with torch.cuda.stream(streams[1]):
            for _ in range(args.layers):
                matmuls(weights, bx)
                attention(bq, bc, bu, args.max_len, D, device)
        for s in streams:
            here.wait_stream(s)

    if args.cpu:
        for fn in (run_attention, run_matmuls, run_sequential):
            fn()
        print("ran (CPU: no streams, no timing)")
        return
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: {args.rows} rows, "
          f"contexts in [256, {args.max_len}), {args.layers} layers per graph")
    with torch.no_grad():
        ms = {name: timed(fn, 1) / 1e3 / args.layers for name, fn in (
            ("attention", run_attention), ("matmuls", run_matmuls),
            ("sequential halves", run_sequential), ("two streams", run_streams))}
    layers = shape["num_hidden_layers"]
    both = ms["attention"] + ms["matmuls"]
    rows = [{"schedule": name, "ms per layer": round(t, 4),
             f"x {layers} layers, ms": round(t * layers, 3),
             "vs attention + matmuls": f"{t / both:.2f}x"} for name, t in ms.items()]
    print_markdown_table(rows, ("schedule", "ms per layer"))
    print(f"# overlap would save {max(0.0, both - ms['two streams']) * layers:.3f} ms a step "
          f"(attention + matmuls {both * layers:.3f} ms, two streams "
          f"{ms['two streams'] * layers:.3f} ms)")


if __name__ == "__main__":
    main()
