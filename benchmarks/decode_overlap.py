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

``--green N [N ...]`` adds, for each N, the same two halves with the GPU's SMs split between
the two kinds of work: every attention on a CUDA green context of N SMs, every matmul on a
green context of the SMs left, each half's layers chained across the two streams by events
(half A's attention beside half B's matmuls, then the other way). Plain two streams let the
GEMMs' programs take every SM, so the attention can only fill gaps; a split keeps both running
at once. Also printed: the attention alone on its N SMs and the matmuls alone on the rest.
Green contexts need a CUDA 12.4 driver or later (made here through the driver API).
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
    p.add_argument("--green", type=int, nargs="*", default=[], metavar="N",
                   help="also split the SMs: attention on a green context of N SMs")
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

    def run_split(green_stream, mm_stream):
        """Half A and half B, each layer's attention on ``green_stream`` and its matmuls on
        ``mm_stream``, chained by events."""
        here = torch.cuda.current_stream()
        for s in (green_stream, mm_stream):
            s.wait_stream(here)
        done = [None, None]  # per half: the event of its last matmuls
        for _ in range(args.layers):
            for i, (hq, hc, hx, hu) in enumerate(halves):
                with torch.cuda.stream(green_stream):
                    if done[i] is not None:
                        green_stream.wait_event(done[i])
                    attention(hq, hc, hu, args.max_len, D, device)
                    att = torch.cuda.Event()
                    att.record(green_stream)
                with torch.cuda.stream(mm_stream):
                    mm_stream.wait_event(att)
                    matmuls(weights, hx)
                    done[i] = torch.cuda.Event()
                    done[i].record(mm_stream)
        for s in (green_stream, mm_stream):
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
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if args.green:  # the split's schedule with every SM open to both streams
        with torch.no_grad():
            ms["split, no green context"] = timed(
                lambda: run_split(torch.cuda.Stream(), torch.cuda.Stream()), 1) / 1e3 / args.layers
    for n in args.green:
        try:
            (att_stream, mm_stream), counts = _sm_partition(n, device)
        except Exception as e:  # noqa: BLE001 - a driver without green contexts
            print(f"# green contexts of {n} SMs: not available ({type(e).__name__}: {e})")
            break
        print(f"# SMs split {counts[0]} (attention) + {counts[1]} (matmuls) of {sms}")

        def on(stream, fn):
            def run():
                here = torch.cuda.current_stream()
                stream.wait_stream(here)
                with torch.cuda.stream(stream):
                    fn()
                here.wait_stream(stream)
            return run

        with torch.no_grad():
            for name, fn in ((f"attention on {counts[0]} SMs", on(att_stream, run_attention)),
                             (f"matmuls on {counts[1]} SMs", on(mm_stream, run_matmuls)),
                             (f"split {counts[0]} + {counts[1]} SMs",
                              lambda: run_split(att_stream, mm_stream))):
                ms[name] = _timed_graph_or_eager(fn) / args.layers
    layers = shape["num_hidden_layers"]
    both = ms["attention"] + ms["matmuls"]
    rows = [{"schedule": name, "ms per layer": round(t, 4),
             f"x {layers} layers, ms": round(t * layers, 3),
             "vs attention + matmuls": f"{t / both:.2f}x"} for name, t in ms.items()]
    print_markdown_table(rows, ("schedule", "ms per layer"))
    best = min((name for name in ms if name.startswith(("two streams", "split"))),
               key=ms.get)
    print(f"# overlap would save {max(0.0, both - ms[best]) * layers:.3f} ms a step "
          f"(attention + matmuls {both * layers:.3f} ms, {best} {ms[best] * layers:.3f} ms)")


def _sm_partition(n: int, device):
    """Two streams on disjoint SMs: one of a green context of ``n`` SMs, one of a green context
    of the SMs left (CUDA driver API, 12.4 or later), and the two SM counts."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")

    def check(result, what):
        if result != 0:
            raise RuntimeError(f"{what} returned CUresult {result}")

    torch.cuda.init()
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), device.index or 0), "cuDeviceGet")
    size = 1024  # larger than a CUdevResource on every CUDA 12 and 13 header
    whole, group, rest = (ctypes.create_string_buffer(size) for _ in range(3))
    check(cuda.cuDeviceGetDevResource(dev, whole, 1), "cuDeviceGetDevResource")  # SM resource
    groups = ctypes.c_uint(1)
    check(cuda.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), whole, rest, 0, n),
          "cuDevSmResourceSplitByCount")
    streams, counts = [], []
    for resource in (group, rest):
        counts.append(ctypes.c_uint.from_buffer(resource, 96).value)  # CUdevSmResource.smCount
        desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(cuda.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1),
              "cuDevResourceGenerateDesc")
        check(cuda.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, 1), "cuGreenCtxCreate")
        check(cuda.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, 1, 0),
              "cuGreenCtxStreamCreate")  # non-blocking
        streams.append(torch.cuda.ExternalStream(stream.value, device=device))
    return streams, counts


def _timed_graph_or_eager(fn) -> float:
    """Milliseconds of fn from a CUDA graph of one call; eager where the graph fails."""
    try:
        return timed(fn, 1) / 1e3
    except Exception as e:  # noqa: BLE001 - a stream a graph does not capture
        print(f"# eager timing ({type(e).__name__}: {str(e)[:100]})")
        torch.cuda.synchronize()
        return _timed_eager(fn)


def _timed_eager(fn) -> float:
    """Milliseconds of fn launched eagerly (a green context's stream is not captured in a CUDA
    graph): CUDA events around five calls, best of five."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 5)
    return best


if __name__ == "__main__":
    main()
