"""What an episode client's completion call costs its process's CPU, by prompt length.

    python benchmarks/agent_client.py            # prompts of 64 to 16,384 ids, 256 new tokens

A workflow's episodes run in the trainer's rank-0 process (threads, or one event loop), so every
call's client-side work is serialized on one core by the GIL: building the request, sending it,
reading the answer and recording its turn. Here the server is an ``httpx.MockTransport`` that
answers at once with a completion of fsdpfn's fields (``prompt_token_ids``, ``token_ids``,
``token_logprobs``, ``weight_versions``), so the times are the client's alone. Rows: the plain
``openai.OpenAI`` client (what any OpenAI-compatible client pays), ``EpisodeClient`` and
``AsyncEpisodeClient`` (fsdpfn.rollout.agent: recording and seeding). A multi-turn episode sends
its whole context as the prompt at every turn, so the prompt grows with the turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from fsdpfn.rollout.agent import AsyncEpisodeClient, EpisodeClient  # noqa: E402


def answer(new: int):
    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        choice = {"index": 0, "text": "x" * new, "finish_reason": "length", "logprobs": None,
                  "prompt_token_ids": prompt, "token_ids": list(range(new)),
                  "token_logprobs": [-0.5] * new, "weight_versions": [1] * new,
                  "weight_version": 1, "temperature": 1.0}
        return httpx.Response(200, json={"id": "c", "object": "text_completion", "created": 0,
                                         "model": "policy", "choices": [choice]})
    return handler


def per_call_ms(call, calls: int) -> float:
    call()  # the first call builds what later ones reuse
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    p.add_argument("--new", type=int, default=256, help="tokens an answer")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    table = []
    for n in args.prompts:
        kwargs = dict(model="policy", prompt=list(range(1, n + 1)), max_tokens=args.new,
                      temperature=1.0)
        plain = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0,
                              http_client=httpx.Client(
                                  transport=httpx.MockTransport(answer(args.new))))
        ours = EpisodeClient("http://127.0.0.1:9", seed=1)
        ours._client._transport.inner = httpx.MockTransport(answer(args.new))
        row = {"prompt ids": f"{n:,}", "new tokens": args.new}
        for name, client in (("openai.OpenAI", plain), ("EpisodeClient", ours)):
            ms = per_call_ms(lambda c=client, k=kwargs: c.completions.create(**k), args.calls)
            row[f"{name} ms"] = f"{ms:.2f}"

        async def run_async(kwargs: dict) -> float:
            client = AsyncEpisodeClient("http://127.0.0.1:9", seed=1)
            client._client._transport.inner = httpx.MockTransport(answer(args.new))
            await client.completions.create(**kwargs)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                await client.completions.create(**kwargs)
            await client.close()
            return (time.perf_counter() - t0) / args.calls * 1e3

        row["AsyncEpisodeClient ms"] = f"{asyncio.run(run_async(kwargs)):.2f}"
        table.append(row)
        print(json.dumps(row), flush=True)
    print(f"openai {openai.__version__}, httpx {httpx.__version__}, {args.calls} calls a cell "
          f"after one warm-up, {os.cpu_count()} CPU cores")
    print_markdown_table(table, ("prompt ids", "new tokens"))


if __name__ == "__main__":
    main()
