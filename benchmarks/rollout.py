"""Rollout benchmark (one GPU): generated tokens/s of the built-in server through
fsdpfn.rollout.generate, and the decode step time against its memory-bandwidth floor.

    python benchmarks/rollout.py                    # decode loop (CUDA graphs), Qwen2-1.5B shape
    python benchmarks/rollout.py --decode hf        # the HF generate path, for comparison
    python benchmarks/rollout.py --rows 512 --no-concurrent
    python benchmarks/rollout.py --seeded           # every request seeded, as the RL recipes send

A random Qwen2-1.5B-shaped model in bf16 is served by ``python -m fsdpfn.rollout`` on the GPU.
Prompts of 256 random tokens (``--prompt``), 8 samples each, temperature 1, no stop token. Each
shape runs as one batched request and as one client per prompt, all at once (threads); each
mode runs once as a warm-up (it captures the CUDA graphs of the row buckets it passes through:
"first wall"), then timed. The step time is the
server's own (decode steps and their seconds, from /get_model_info); the floor is the bytes one
step must read (all weights, plus the KV cache of every row at its mean context) over the GPU's
measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402 - benchmarks/ is this script's folder
from fsdpfn.rollout import generate, launch_server  # noqa: E402

QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True)
SHAPES = [(64, 512), (256, 512), (512, 1024), (1024, 1024)]  # (rows in flight, new tokens)
N, PROMPT = 8, 256  # samples a prompt; prompt tokens (--prompt)


def build_model(path: str) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_1_5B), dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy (bytes read + written), best of 10."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def floor_ms(rows: int, new: int, bandwidth: float, prompt: int = PROMPT,
             kv_bytes: int = 2) -> float:
    c = QWEN2_1_5B
    weights = 2 * (c["vocab_size"] * c["hidden_size"] + c["num_hidden_layers"] * (
        c["hidden_size"] * (c["hidden_size"] + 2 * 256) + c["hidden_size"] ** 2
        + 3 * c["hidden_size"] * c["intermediate_size"]))  # bf16; q 1536, k/v 256 wide
    kv_per_token = 2 * kv_bytes * c["num_hidden_layers"] * c["num_key_value_heads"] * 128
    kv = rows * (prompt + new / 2) * kv_per_token
    return (weights + kv) / (bandwidth * 1e9) * 1e3


def run(url: str, rows: int, new: int, concurrent: bool, seeded: bool = False,
        prompt: int = PROMPT) -> float:
    g = torch.Generator().manual_seed(rows + new)
    prompts = torch.randint(0, QWEN2_1_5B["vocab_size"], (rows // N, prompt), generator=g).tolist()
    kwargs = dict(n=N, max_new_tokens=new, temperature=1.0, timeout=3600,
                  seed=rows + new if seeded else None)
    clock = time.perf_counter()
    if not concurrent:
        out = generate(url, prompts, **kwargs)["outputs"]
    else:
        answers = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(
            i, generate(url, [prompts[i]], **kwargs))) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out = [o for a in answers for o in a["outputs"]]
    wall = time.perf_counter() - clock
    assert sum(len(o["output_ids"]) for o in out) == rows * new, "a row ended early"
    return wall


def add_decode_options(p: argparse.ArgumentParser) -> None:
    """The decode loop's opt-in options (the server's flags of the same names)."""
    p.add_argument("--decode-attention", default="auto",
                   choices=("auto", "flash", "triton", "sdpa", "flex", "matmul"))
    p.add_argument("--decode-compile", action="store_true",
                   help="the decode step through torch.compile")
    p.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="Liger's fused RMSNorm and SwiGLU in the served model (the default)")
    p.add_argument("--decode-rope-kv", default=None, choices=("auto", "torch", "triton"),
                   help="the rotary/KV-write kernel (default: the server's)")
    p.add_argument("--decode-share-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="a prompt's KV read once for its samples (the server's default)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                   help="the decode cache's element type (the server's flag)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--decode", default="loop", choices=("loop", "hf"))
    p.add_argument("--rows", type=int, nargs="*", default=None, help="only these shapes")
    p.add_argument("--no-concurrent", action="store_true")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--seeded", action="store_true",
                   help="seed every request (the RL recipes do: reproducible runs)")
    p.add_argument("--prompt", type=int, default=PROMPT, help="tokens a prompt")
    p.add_argument("--slots", type=int, default=1024,
                   help="the server's --decode-rows (the KV cache's rows; the RL recipes pass "
                        "exactly the rows of a step)")
    add_decode_options(p)
    args = p.parse_args()
    bandwidth = copy_bandwidth()
    kv = 1 if args.kv_cache_dtype == "fp8_e4m3" else 2  # bytes a cached value
    print(f"device copy bandwidth: {bandwidth:.0f} GB/s", flush=True)
    shapes = [s for s in SHAPES if not args.rows or s[0] in args.rows]
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        extra = ("--decode", args.decode, "--decode-rows", str(args.slots), "--decode-max-len",
                 str(args.prompt + max(n for _, n in shapes)), "--no-channel")
        extra += ("--no-cuda-graphs",) if args.no_cuda_graphs else ()
        extra += ("--fused-kernels",) if args.fused_kernels else ("--no-fused-kernels",)
        extra += ("--decode-attention", args.decode_attention)
        extra += ("--decode-compile",) if args.decode_compile else ()
        extra += ("--decode-rope-kv", args.decode_rope_kv) if args.decode_rope_kv else ()
        extra += () if args.decode_share_prefix else ("--no-decode-share-prefix",)
        extra += ("--kv-cache-dtype", args.kv_cache_dtype)
        with launch_server(tmp, device="cuda", dtype="bfloat16", threads=4,
                           health_timeout=900, extra_args=extra) as server:
            for rows, new in shapes:
                for concurrent in ([False] if args.no_concurrent else [False, True]):
                    # a warm-up in the same mode first: it captures the CUDA graphs of the row
                    # buckets this mode passes through (one client per prompt is admitted over
                    # several rounds), so the timed run is the steady state a training loop sees
                    first = run(server.url, rows, new, concurrent, args.seeded, args.prompt)
                    before = server.get("/get_model_info").get("decode_stats") or {}
                    wall = run(server.url, rows, new, concurrent, args.seeded, args.prompt)
                    after = server.get("/get_model_info").get("decode_stats") or {}
                    steps = after.get("steps", 0) - before.get("steps", 0)
                    step_s = after.get("seconds", 0) - before.get("seconds", 0)
                    step_ms = step_s / steps * 1e3 if steps else float("nan")
                    prefill = after.get("prefill_seconds", 0) - before.get("prefill_seconds", 0)
                    row = {"rows in flight": f"{rows} ({rows // N} x {N})", "new tokens": new,
                           "clients": rows // N if concurrent else 1,
                           "seeded": "yes" if args.seeded else "no",
                           "first wall (s)": f"{first:.1f}", "wall (s)": f"{wall:.1f}",
                           "generated tokens/s": f"{rows * new / wall:,.0f}",
                           "decode steps": steps, "step (ms)": f"{step_ms:.2f}",
                           "shared steps": after.get("shared_steps", 0)
                           - before.get("shared_steps", 0),
                           # the wall outside the steps and the prefill: the request and answer
                           # (JSON, HTTP), admission bookkeeping, idle waits
                           "prefill (s)": f"{prefill:.2f}",
                           "outside (s)": f"{wall - step_s - prefill:.2f}",
                           "prompt": args.prompt,
                           "kv cache": args.kv_cache_dtype,
                           "floor (ms)": f"{floor_ms(rows, new, bandwidth, args.prompt, kv):.2f}",
                           "graphs": after.get("graphs", "")}
                    table.append(row)
                    print(json.dumps(row), flush=True)
            print(server.log()[-1500:])
    print_markdown_table(table, ("rows in flight", "new tokens", "clients"))


if __name__ == "__main__":
    main()
