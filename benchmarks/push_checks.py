"""The receiver's per-bucket checks on one GPU, kernel by kernel (CUDA events): what a weight push
pays after each bucket's bytes land. Layout: the largest default bucket of the Qwen2-1.5B shape.

    python benchmarks/push_checks.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from fsdpfn.weights.gather import plan_buckets  # noqa: E402
from fsdpfn.wire.protocol import flat_checksums, padded_size, zero_padding  # noqa: E402


def shapes_1_5b():
    h, i, kv, v = 1536, 8960, 256, 151936
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(28):
        p = f"model.layers.{layer}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,))]


def timed(fn, reps=10):
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    params = [(n, torch.empty(s, device="meta")) for n, s in shapes_1_5b()]
    buckets = plan_buckets(params, torch.bfloat16, 1 << 30, 32 << 20)
    b = max(buckets, key=lambda b: b.nbytes)
    sizes = [s.nbytes for s in b.specs]
    buf = torch.randint(0, 255, (padded_size(b.nbytes),), dtype=torch.uint8, device="cuda")
    zero_padding(buf, b.offsets, sizes)
    buf[b.nbytes:].zero_()
    x = buf[:b.nbytes].view(torch.bfloat16)
    x.view(torch.int16).bitwise_and_(0x3FFF)  # finite values
    words = buf.view(torch.int32)
    gb = b.nbytes / 1e9
    rows = []

    def add(name, fn):
        ms = timed(fn)
        rows.append({"kernel": name, "ms": round(ms, 3), "GB/s": round(gb / ms * 1e3, 1)})

    add("copy (reference: read + write)", lambda: buf.clone())
    add("zero_padding (index_fill of the gaps)", lambda: zero_padding(buf, b.offsets, sizes))
    add("flat_checksums", lambda: flat_checksums(buf, b.offsets, sizes))
    add("rows: view(-1, 1024).sum(1, int64)", lambda: words.view(-1, 1024).sum(1, dtype=torch.int64))
    add("rows: view(-1, 1024).sum(1) int32 (wraps)", lambda: words.view(-1, 1024).sum(1, dtype=torch.int32))
    add("rows: view(-1, 1024).to(int64).sum(1)", lambda: words.view(-1, 1024).to(torch.int64).sum(1))
    add("all: words.sum(int64)", lambda: words.sum(dtype=torch.int64))
    add("isfinite(x).all()", lambda: torch.isfinite(x).all())
    add("x.view(-1, 2048).sum(1, float32)", lambda: x.view(-1, 2048).sum(1, dtype=torch.float32))
    add("x.float().sum()", lambda: x.sum(dtype=torch.float32))
    add("aminmax(x)", lambda: torch.aminmax(x))
    add("(x_int16 & 0x7F80).amax()", lambda: (x.view(torch.int16) & 0x7F80).amax())
    print(f"# {torch.cuda.get_device_name()}, bucket {b.index}: {len(b.specs)} tensors, "
          f"{gb:.3f} GB")
    print_markdown_table(rows, ("kernel",))


if __name__ == "__main__":
    main()
