"""The /generate answer's cost outside the decode steps: fsdpfn's plain JSON answer against the
packed one (fsdpfn/rollout/packing.py), through a real server process.

    python benchmarks/answer.py                     # CPU, a tiny model, 512 rows x 480 tokens
    python benchmarks/answer.py --device cuda --rows 512 --new 1024 --max-len 1280
    python benchmarks/answer.py --parts --rows 512 --new 1024   # the packed answer's parts

The model is tiny on purpose: the answer's size depends on the tokens, not on the model. Each
format runs --repeats times, alternating. Per run: the wall of one batched request as the
client sees it (the packed answer unpacked into the plain lists, as fsdpfn.rollout.generate
returns it), the server's decode-step and prefill seconds (/get_model_info), and the rest:
writing, sending and reading the request and the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402

from fsdpfn.rollout import launch_server, packing  # noqa: E402
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config  # noqa: E402
from fsdpfn.wire.http import call  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=512, help="rows in flight (8 samples a prompt)")
    p.add_argument("--new", type=int, default=480, help="new tokens per row")
    p.add_argument("--max-len", type=int, default=512, help="the server's --decode-max-len")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--parts", action="store_true",
                   help="no server: time each part of the packed answer's path in this process")
    args = p.parse_args()
    if args.parts:
        return parts(args.rows, args.new, args.repeats)
    config = tiny_qwen2_config()
    config.max_position_embeddings = max(config.max_position_embeddings, args.max_len)
    path = save_tiny_model(tempfile.mkdtemp(prefix="fsdpfn-answer-") + "/tiny", config, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 100, (args.rows // 8, 16), generator=g).tolist()
    body = {"input_ids": prompts, "return_logprob": True, "sampling_params": {
        "n": 8, "max_new_tokens": args.new, "temperature": 1.0}}
    table = []
    extra = ("--decode", "loop", "--decode-rows", str(args.rows), "--decode-max-len",
             str(args.max_len))
    with launch_server(path, device=args.device, threads=2, extra_args=extra) as server:
        call(server.url, "/generate", {**body, "return_format": "fsdpfn"}, timeout=3600)  # warm
        for _ in range(args.repeats):
            for fmt in ("fsdpfn", "fsdpfn_packed"):
                before = server.get("/get_model_info")["decode_stats"]
                clock = time.perf_counter()
                answer = call(server.url, "/generate", {**body, "return_format": fmt},
                              timeout=3600)
                plain = packing.unpack(answer) if fmt == "fsdpfn_packed" else answer
                wall = time.perf_counter() - clock
                size, answer = len(json.dumps(answer)), plain
                after = server.get("/get_model_info")["decode_stats"]
                steps = after["seconds"] - before["seconds"]
                prefill = after["prefill_seconds"] - before["prefill_seconds"]
                row = {"return_format": fmt,
                       "tokens": sum(len(o["output_ids"]) for o in answer["outputs"]),
                       "answer MB": f"{size / 1e6:.1f}", "wall s": f"{wall:.2f}",
                       "steps s": f"{steps:.2f}", "prefill s": f"{prefill:.2f}",
                       "the rest s": f"{wall - steps - prefill:.2f}"}
                table.append(row)
                print(json.dumps(row), flush=True)
    print(f"# {args.device}, {os.cpu_count()} CPUs: {args.rows} rows x {args.new} new tokens")
    print_markdown_table(table, ("return_format", "tokens"))


def parts(rows: int, new: int, repeats: int) -> None:
    """Each step of the packed answer's path outside the decode steps, on rows x new tokens of
    one weight version, best of ``repeats`` + 2, in this process: the per-row dicts of the
    decode loop's tensor rows (as Decoder._deliver builds them), packing.pack from those
    tensors, the JSON written and read, packing.unpack (the client). Beside the total: the
    server's path before it packed tensors (tolist, then pack from lists)."""
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 151936, (rows, new), generator=g, dtype=torch.int64)
    lp = -torch.rand(rows, new, generator=g) * 10
    table, total = [], 0.0

    def timed(name, fn, counted=True):
        nonlocal total
        best = float("inf")
        for _ in range(repeats + 2):
            clock = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - clock)
        total += best if counted else 0.0
        table.append({"part": name, "ms": f"{best * 1e3:.1f}"})
        return out

    def dicts(toks, lps):
        return [{"prompt_index": r // 8, "output_ids": toks[r], "output_logprobs": lps[r],
                 "finish_reason": "length", "weight_versions": [0] * new} for r in range(rows)]

    outputs = timed("the rows' dicts (tensor rows, as Decoder._deliver builds them)",
                    lambda: dicts(tok, lp))
    packed = timed("packing.pack (from the tensors)",
                   lambda: packing.pack({"weight_version": 0, "outputs": outputs}))
    body = timed("json.dumps (the server's body)", lambda: json.dumps(packed).encode())
    read = timed("json.loads (the client)", lambda: json.loads(body))
    plain = timed("packing.unpack (the client)", lambda: packing.unpack(read))
    assert [o["output_ids"] for o in plain["outputs"]] == tok.tolist()
    table.append({"part": "total", "ms": f"{total * 1e3:.1f}"})
    before = timed("(before: tolist, the rows' dicts of lists, pack from lists; not in the "
                   "total)", lambda: packing.pack({"weight_version": 0, "outputs": dicts(
                       tok.tolist(), lp.tolist())}), counted=False)
    assert before == packed
    print(f"# {os.cpu_count()} CPUs: {rows} rows x {new} new tokens, {len(body) / 1e6:.1f} MB")
    print_markdown_table(table, ("part",))


if __name__ == "__main__":
    main()
