"""Would a float8 KV cache bring the decode step to 4.8 ms? (one GPU; before building a path)

    python benchmarks/decode_kv_fp8.py               # 512 and 1,024 rows, Qwen2-1.5B's layer

At 512 rows the attention is about 2.6 ms of the H200's 5.9 ms step, and it reads the cache at
the HBM's rate (BENCHMARKS.md, "Decode attention kernel"): half the bytes a position would be
about half that time. This times fsdpfn's split-KV Triton kernel on one layer's slot cache held
in bf16 and in float8_e4m3 (the same values cast, scale 1 as SGLang's fp8_e4m3 KV cache without
checkpoint scales; the kernel widens each block to bf16 after its load), with random lengths in
[--min-pos, --max-len) and with shared prompts (groups of 8 rows, as the decode loop runs
them), L2 evicted before each call as the step's matmuls do. Also the output's largest
difference from a float64 attention over the bf16 cache, for both. Nothing in the server changes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from decode_attention import slot_cache, timed  # noqa: E402 - timed: a CUDA graph of n calls

from fsdpfn.rollout import attention_kernel  # noqa: E402


def reference(q, k, v, used, scale):
    """float64 attention of each row's query heads over its first used[r] positions."""
    R, heads, D = q.shape
    G = heads // k.shape[1]
    out = torch.empty(R, heads, D, dtype=torch.float64, device=q.device)
    for r in range(R):
        n = int(used[r])
        kk = k[r, :, :n].double().repeat_interleave(G, 0)  # [heads, n, D]
        vv = v[r, :, :n].double().repeat_interleave(G, 0)
        att = torch.softmax((kk @ q[r].double()[:, :, None])[..., 0] * scale, -1)
        out[r] = (att[:, None, :] @ vv)[:, 0]
    return out.view(R, heads * D)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--max-len", type=int, default=1280)
    p.add_argument("--min-pos", type=int, default=256)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    kv, heads, D, layers = 2, 12, 128, 28
    flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: one layer's cache, "
          f"{heads} query heads on {kv} kv heads, D={D}, lengths in [{args.min_pos}, "
          f"{args.max_len})")
    table = []
    for R in args.rows:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, shared = slot_cache(R, heads, kv, D, args.max_len, args.min_pos, args.samples, g)
        used = torch.randint(args.min_pos + 1, args.max_len + 1, (R,), generator=g,
                             device="cuda", dtype=torch.int32)
        k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scale = D ** -0.5
        some = torch.arange(0, R, max(1, R // 16), device="cuda")
        ref = reference(q[some], k[some], v[some], used[some], scale)
        for cache, (kc, vc) in (("bf16", (k, v)), ("float8_e4m3", (k8, v8))):
            out = attention_kernel.decode(q, kc, vc, used, args.max_len, scale)
            err = (out[some].double() - ref).abs().max().item()
            for name, kw in (("random lengths", {}), (f"shared prompts ({args.samples} rows)",
                                                      {"shared": shared})):
                us = timed(lambda kw=kw: attention_kernel.decode(
                    q, kc, vc, used, args.max_len, scale, **kw), args.iters, flush=flush)
                table.append({"rows": R, "cache": cache, "case": name, "µs a layer": round(us, 1),
                              f"x {layers} layers, ms": round(us * layers / 1e3, 3),
                              "max |out - float64|": f"{err:.1e}"})
    print_markdown_table(table, ("rows", "cache", "case"))


if __name__ == "__main__":
    main()
