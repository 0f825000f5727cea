"""The decode loop's network step per kernel option (one GPU): the step of the built-in server's
decode loop (fsdpfn/rollout/slot_model.py), captured in a CUDA graph and replayed, for each
attention kernel and with or without Liger's fused RMSNorm and SwiGLU (``--fused-kernels``).

    python benchmarks/decode_step.py                     # Qwen2-1.5B shape, 512 and 1,024 rows
    python benchmarks/decode_step.py --cpu               # a smoke run (tiny model, CPU, eager)

Each row: rows R, each at a random position in [--min-pos, --max-len), attending the first
--max-len columns (the loop's largest length bucket); milliseconds per step (the network and the
lm_head; sampling not included), the logits' gap to the first option's (a kernel that computes
something else shows here), against the floor of reading the weights and every row's KV
cache once at the copy bandwidth measured in the same run. The last line names the fastest
option as server flags (``best: ...``), for the benchmark that runs the whole loop next.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from rollout import QWEN2_1_5B, copy_bandwidth  # noqa: E402 - benchmarks/rollout.py

from fsdpfn.rollout.slot_model import SlotModel  # noqa: E402

# (name, attention, fused modules); the fused rows run after the model's modules are swapped
# for Liger's, so they come last
OPTIONS = (("sdpa", "sdpa", False), ("flash", "flash", False), ("triton", "triton", False),
           ("matmul", "matmul", False), ("flex", "flex", False), ("fused, sdpa", "sdpa", True),
           ("fused, flash", "flash", True), ("fused, triton", "triton", True),
           ("fused, matmul", "matmul", True), ("fused, flex", "flex", True),
           ("fused, triton, rope-kv", "triton", True),
           ("fused, triton, rope-kv, add-norm", "triton", True))
# "rope-kv": SlotModel(rope_kv="triton"), the rotary, q layout and KV writes in one kernel (the
# server's --decode-rope-kv; its default "auto" takes it where it runs); "add-norm":
# SlotModel(add_norm=True), each residual add and the Liger norm after it as one kernel (the
# server's default where its norms are Liger's); the other rows: rope_kv="torch", add_norm=False


def kernels(name: str) -> dict:
    """The SlotModel options a row's name asks for."""
    return {"rope_kv": "triton" if "rope-kv" in name else "torch", "add_norm": "add-norm" in name}


def capture(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of fn, after two warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def time_step(model, rows: int, max_len: int, min_pos: int, attention: str,
              graphs: bool, iters: int, **options) -> tuple[float, torch.Tensor]:
    net = SlotModel(model, rows, max_len, attention, **options)
    g = torch.Generator(device=net.device).manual_seed(0)
    for k, v in zip(net.k, net.v):
        k.normal_(generator=g)
        v.normal_(generator=g)
    tok = torch.randint(0, model.config.vocab_size, (rows,), device=net.device, generator=g)
    pos = torch.randint(min_pos, max_len, (rows,), device=net.device, generator=g)
    step = functools.partial(net.decode, tok, pos, max_len)
    with torch.no_grad():
        logits = step()[:, :4096].clone()  # eager, before any capture: compared across options
        if graphs:
            run = capture(step).replay
        else:
            run = step
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    del net, step, run
    gc.collect()
    torch.cuda.empty_cache()
    return ms, logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--max-len", type=int, default=1280)
    p.add_argument("--min-pos", type=int, default=256)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--options", nargs="+", default=[o[0] for o in OPTIONS],
                   choices=[o[0] for o in OPTIONS])
    p.add_argument("--cpu", action="store_true", help="a smoke run: tiny model on CPU")
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.cpu:
        shape = dict(QWEN2_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        device, dtype = torch.device("cpu"), torch.float32
        args.rows, args.max_len, args.min_pos, args.iters = [4], 64, 8, 2
    else:
        shape, device, dtype = QWEN2_1_5B, torch.device("cuda"), torch.bfloat16
    shape = dict(shape)
    config = AutoConfig.for_model(shape.pop("model_type", "qwen2"), **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    bw = copy_bandwidth() * 1e9 if device.type == "cuda" else None  # bytes/s
    if bw:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: copy bandwidth "
              f"{bw / 1e9:.0f} GB/s, weights {weight_bytes / 1e9:.2f} GB")
    results, fused_on, reference = [], False, {}
    for name, attention, fused in OPTIONS:
        if name not in args.options or (attention in ("flash", "triton")
                                         and device.type != "cuda"):
            continue  # flash and the Triton attention run on CUDA only
        if fused and not fused_on:
            if device.type != "cuda":
                break
            from fsdpfn.engine.shard import apply_fused_kernels

            if not apply_fused_kernels(model, config, "cuda", keep_weights=True):
                print("# liger_kernel not installed: the fused rows are skipped")
                break
            model.eval().requires_grad_(False)
            fused_on = True
        for rows in args.rows:
            kv_bytes = SlotModel.kv_bytes_per_slot(model, args.max_len) * rows * \
                (args.max_len + args.min_pos) / 2 / args.max_len  # the columns each row reads
            row = {"option": name, "rows": rows}
            if device.type == "cuda":
                ms, logits = time_step(model, rows, args.max_len, args.min_pos, attention, True,
                                       args.iters, **kernels(name))
                want = reference.setdefault(rows, logits.float())  # the first option's
                gap = (logits.float() - want).abs()
                floor = (weight_bytes + kv_bytes) / bw * 1e3
                row.update({"max |dlogit|": round(float(gap.max()), 3),
                            "mean |dlogit|": round(float(gap.mean()), 4),
                            "step ms": round(ms, 3), "floor ms": round(floor, 3),
                            "of floor": f"{ms / floor:.1f}x",
                            "tokens/s": round(rows / ms * 1e3)})
            else:
                SlotModel(model, rows, args.max_len, attention).decode(
                    torch.zeros(rows, dtype=torch.long), torch.full((rows,), 9), args.max_len)
                row["step ms"] = "ran"
            print(row, flush=True)
            results.append(row)
    print_markdown_table(results, ("option", "rows"))
    timed = [r for r in results if isinstance(r["step ms"], float) and r["rows"] == args.rows[0]]
    if timed:
        best = min(timed, key=lambda r: r["step ms"])
        name, attention, fused = next(o for o in OPTIONS if o[0] == best["option"])
        extra = kernels(best["option"])
        flags = ["--decode-attention", attention,
                 "--fused-kernels" if fused else "--no-fused-kernels",
                 "--decode-rope-kv", extra["rope_kv"]]
        print("best:", " ".join(flags))


if __name__ == "__main__":
    main()
