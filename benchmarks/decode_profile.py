"""Where the decode loop's step time goes (one GPU): a torch.profiler run of the built-in server's
engine in this process, kernel time per decode step by category.

    python benchmarks/decode_profile.py                    # 512 rows, Qwen2-1.5B shape, graphs
    python benchmarks/decode_profile.py --no-cuda-graphs   # the same steps eagerly
    python benchmarks/decode_profile.py --cpu              # a smoke run (tiny model, CPU)

Prompts of 256 random tokens, 8 samples each, temperature 1. A first generate of the same shape
captures the CUDA graphs; the profiled one generates --new tokens per row. Prints the top kernels
by device time, then the device time per decode step by category (matmul, attention, sampling,
norm / rotary / elementwise, copies) against the wall time per step, and writes a Chrome trace
(--trace).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from rollout import QWEN2_1_5B, add_decode_options  # noqa: E402 - benchmarks/rollout.py

CATEGORIES = (  # first match wins, on the lower-cased kernel name
    ("matmul", r"gemm|cutlass|nvjet|cublas|sm90_xmma|matmul|splitk"),
    ("attention", r"fmha|attention|flash|flex|triton_tem|sdpa|softmax_warp"),
    ("sampling", r"chunk_kernel|pick_kernel|exponential|argmax|logsumexp|topk|sort|cumsum|philox|distribution"),
    ("copies", r"memcpy|memset|copy|index_put|indexing|scatter|gather|cat"),
    ("norm / rotary / elementwise", r"."),
)


def category(name: str) -> str:
    low = name.lower()
    return next(c for c, pattern in CATEGORIES if re.search(pattern, low))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--new", type=int, default=64, help="new tokens per row, profiled")
    p.add_argument("--no-cuda-graphs", action="store_true")
    add_decode_options(p)
    p.add_argument("--trace", default=None, help="write a Chrome trace here")
    p.add_argument("--cpu", action="store_true", help="a smoke run: tiny model on CPU")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fsdpfn.rollout import RolloutEngine, SamplingParams

    device = "cpu" if args.cpu else "cuda"
    shape = dict(QWEN2_1_5B, **(dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4)
                                if args.cpu else {}))
    rows, prompt_len = (16, 16) if args.cpu else (args.rows, 256)
    path = tempfile.mkdtemp(prefix="fsdpfn-decode-profile-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.bfloat16).save_pretrained(
        path, safe_serialization=True)
    engine = RolloutEngine(path, dtype="bfloat16", device=device, decode="loop" if not args.cpu
                           else "auto", decode_rows=rows, decode_max_len=prompt_len + 2 * args.new
                           + 64, cuda_graphs=not args.no_cuda_graphs,
                           fused_kernels=args.fused_kernels,
                           decode_attention=args.decode_attention,
                           decode_compile=args.decode_compile,
                           decode_rope_kv=args.decode_rope_kv or "auto",
                           decode_share_prefix=args.decode_share_prefix,
                           kv_cache_dtype=args.kv_cache_dtype)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, shape["vocab_size"], (rows // 8, prompt_len), generator=g).tolist()
    sp = SamplingParams(n=8, max_new_tokens=args.new, temperature=1.0)
    engine.generate(prompts, sp)  # captures the graphs of these shapes
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    sync()
    clock = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        engine.generate(prompts, sp)
        sync()
    wall = time.perf_counter() - clock
    if args.trace:
        prof.export_chrome_trace(args.trace)
    events = [e for e in prof.key_averages() if e.device_type.name == ("CUDA" if device == "cuda"
                                                                        else "CPU")]
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events.sort(key=lambda e: -getattr(e, key))
    steps = args.new - 1  # the first token of each row comes from the prefill
    print(f"# {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch "
          f"{torch.__version__}: {rows} rows, prompts of {prompt_len}, {args.new} new tokens, "
          f"graphs {'off' if args.no_cuda_graphs else 'on'}, fused modules {engine.fused}, "
          f"{args.decode_attention} attention{', compiled' if args.decode_compile else ''}, "
          f"rotary/KV {engine._decoder.net.rope_kv if engine._decoder else '-'}; "
          f"wall {wall:.3f} s = "
          f"{wall / steps * 1e3:.2f} ms per step (prefill included)")
    top = [{"kernel": e.key[:90], "category": category(e.key), "calls": e.count,
            "ms per step": round(getattr(e, key) / 1e3 / steps, 3)} for e in events[:30]]
    print_markdown_table(top, ("kernel", "category", "calls", "ms per step"))
    totals: dict[str, float] = {}
    for e in events:
        totals[category(e.key)] = totals.get(category(e.key), 0.0) + getattr(e, key) / 1e3
    rows_out = [{"category": c, "ms per step": round(v / steps, 3)}
                for c, v in sorted(totals.items(), key=lambda kv: -kv[1])]
    rows_out.append({"category": "all kernels", "ms per step": round(sum(totals.values()) / steps,
                                                                      3)})
    rows_out.append({"category": "wall", "ms per step": round(wall / steps * 1e3, 3)})
    print_markdown_table(rows_out, ("category", "ms per step"))


if __name__ == "__main__":
    main()
