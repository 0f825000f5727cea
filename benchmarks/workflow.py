"""Rollout workflows against the plain batched request: what an episode's openai client costs.

    python benchmarks/workflow.py                       # CPU: the demo's model, 64 prompts x 8
    python benchmarks/workflow.py --device cuda --shape 1.5b --prompts 64 --new 256

One server (``python -m fsdpfn.rollout``) on a random model: the grpo demo's tiny Qwen2 on the
CPU (``--shape demo``), a 4-layer one of hidden 512 and 32,000 tokens (``--shape small``), or
the Qwen2-1.5B shape in bf16 (``--shape 1.5b``). The same prompts
(random tokens) are generated, ``--n`` samples each, ``--new`` new tokens at temperature 1 with no
stop token, three ways, each after a warm-up of its own:

- ``generate``: one batched request (fsdpfn.rollout.generate), as the recipes send without a
  workflow;
- ``workflow (def)``: fsdpfn.app.recipes.workflow.run_episodes with a plain-def workflow of one
  completion call, so one ``EpisodeClient`` (openai.OpenAI) and one thread an episode;
- ``workflow (async def)``: the same with an ``async def`` workflow, one ``AsyncEpisodeClient``
  an episode on one event loop.

Each row gives the wall time, the generated tokens/s, the server's decode steps and their seconds
(from /get_model_info), its prefill's seconds and prompts (the decode loop prefills equal prompts
admitted together once), the wall outside them (what the requests, the clients and the threads
cost beside the model), and this process's garbage collection: the full collections and the
seconds of every collection during the row.

Once the server is up, this process collects and freezes what is alive
(``fsdpfn.wire.lifeline.freeze_long_lived``), as the trainer ranks of ``fsdpfn run`` do at their
loop's start; ``--no-freeze`` leaves it out (a loop of a user's own that does not freeze).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402 - benchmarks/ is this script's folder
from fsdpfn.rollout import generate, launch_server  # noqa: E402
from rollout import QWEN2_1_5B  # noqa: E402 - benchmarks/rollout.py's shape

SHAPES = {"demo": dict(vocab_size=32, hidden_size=128, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=256, tie_word_embeddings=True),
          "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=2048, tie_word_embeddings=True),
          "1.5b": QWEN2_1_5B}


def build_model(path: str, shape: str, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]), dtype=dtype)
    model.save_pretrained(path, safe_serialization=True)


def one_call(client, row):
    """A plain-def workflow of one completion call: the episode's reward is its length."""
    out = client.completions.create(model="policy", prompt=row["prompt_ids"],
                                    max_tokens=row["max_tokens"],
                                    temperature=1.0)
    return float(len(out.choices[0].token_ids))


async def one_call_async(client, row):
    out = await client.completions.create(model="policy", prompt=row["prompt_ids"],
                                          max_tokens=row["max_tokens"], temperature=1.0)
    return float(len(out.choices[0].token_ids))


class GcClock:
    """Every collection of this process, timed through ``gc.callbacks``."""

    def __init__(self):
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._t0
        self.full += info["generation"] == 2

    def reset(self) -> None:
        self.seconds, self.full = 0.0, 0


GC = GcClock()


def timed(server, fn) -> dict:
    before = server.get("/get_model_info").get("decode_stats") or {}
    GC.reset()
    t0 = time.perf_counter()
    tokens = fn()
    wall = time.perf_counter() - t0
    collections = (GC.full, GC.seconds)
    after = server.get("/get_model_info").get("decode_stats") or {}
    steps = after.get("steps", 0) - before.get("steps", 0)
    seconds = after.get("seconds", 0) - before.get("seconds", 0)
    prefill = after.get("prefill_seconds", 0) - before.get("prefill_seconds", 0)
    prompts = after.get("prefill_prompts", 0) - before.get("prefill_prompts", 0)
    return {"wall (s)": f"{wall:.2f}", "generated tokens/s": f"{tokens / wall:,.0f}",
            "decode steps": steps, "steps (s)": f"{seconds:.2f}", "prefill (s)": f"{prefill:.2f}",
            "prompts prefilled": prompts,
            "outside (s)": f"{wall - seconds - prefill:.2f}",
            "full collections": collections[0], "collections (s)": f"{collections[1]:.2f}"}


def main() -> None:
    from fsdpfn.app.recipes.workflow import load_workflow, run_episodes

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default=None, choices=tuple(SHAPES),
                   help="demo on the CPU, 1.5b on a GPU by default")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples (episodes) a prompt")
    p.add_argument("--prompt", type=int, default=8, help="tokens a prompt")
    p.add_argument("--new", type=int, default=8, help="new tokens a sample")
    p.add_argument("--threads", type=int, default=1, help="the server's CPU threads")
    p.add_argument("--decode", default="auto", choices=("auto", "loop", "hf"),
                   help="the server's --decode (auto: the loop on CUDA, HF generate on the CPU)")
    p.add_argument("--no-freeze", action="store_true",
                   help="do not freeze what this process holds once the server is up")
    args = p.parse_args()
    shape = args.shape or ("demo" if args.device == "cpu" else "1.5b")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[shape]["vocab_size"]
    prompts = [torch.randint(1, vocab, (args.prompt,), generator=g).tolist()
               for _ in range(args.prompts)]
    rows = [{"prompt_ids": ids, "max_tokens": args.new} for ids in prompts]
    flows = {"workflow (def)": load_workflow(f"{os.path.abspath(__file__)}:one_call"),
             "workflow (async def)": load_workflow(f"{os.path.abspath(__file__)}:one_call_async")}
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp, shape, dtype)
        rows_in_flight = args.prompts * args.n
        extra = ("--decode-rows", str(rows_in_flight), "--decode-max-len",
                 str(args.prompt + args.new), "--no-channel", "--decode", args.decode)
        with launch_server(tmp, device=args.device, dtype=str(dtype).split(".")[1],
                           threads=args.threads, health_timeout=900,
                           extra_args=extra) as server:
            if not args.no_freeze:
                from fsdpfn.wire.lifeline import freeze_long_lived

                freeze_long_lived()
            def batched():
                out = generate(server.url, prompts, n=args.n, max_new_tokens=args.new,
                               temperature=1.0)
                return sum(len(o["output_ids"]) for o in out["outputs"])

            def episodes(flow):
                def go():
                    results = run_episodes(server.url, flow, rows, args.n, timeout_s=600.0)
                    errors = [r.error for r in results if r.error]
                    if errors:
                        raise RuntimeError(f"{len(errors)} episodes failed: {errors[0]}")
                    return sum(sum(len(t.output_ids) for t in r.turns) for r in results)
                return go

            for name, fn in [("generate", batched),
                             *((k, episodes(f)) for k, f in flows.items())]:
                fn()  # warm-up: the same requests once
                row = {"how": name, "episodes": rows_in_flight, "new tokens": args.new,
                       **timed(server, fn)}
                table.append(row)
                print(json.dumps(row), flush=True)
    print(f"device {args.device} (--decode {args.decode}), shape {shape}, {args.prompts} prompts "
          f"x {args.n} samples, prompts of {args.prompt} tokens, {args.new} new tokens, "
          f"server threads {args.threads}, frozen after setup: {not args.no_freeze}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores")
    print_markdown_table(table, ("how", "episodes", "new tokens"))


if __name__ == "__main__":
    main()
