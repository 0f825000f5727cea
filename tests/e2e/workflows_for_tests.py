"""Workflows the workflow tests name by spec (tests/e2e/test_workflows.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time
from pathlib import Path

FEEDBACK = " wrong, try again: "


def retry(client, row):
    """Two turns on token ids: answer, then (whatever the answer) feedback and a second answer
    that extends the first turn's context. Reward 1 when the second answer is non-empty."""
    ids = row["prompt_ids"]
    first = client.completions.create(model="policy", prompt=ids, max_tokens=5, temperature=1.0)
    context = first.choices[0].prompt_token_ids + first.choices[0].token_ids
    follow = context + row["feedback_ids"]
    second = client.completions.create(model="policy", prompt=follow, max_tokens=4,
                                       temperature=1.0)
    return [0.0, float(len(second.choices[0].token_ids) > 0)]


async def chat_twice(client, row):
    """The openai package's async chat API directly: ask, then ask again with the answer in the
    history (re-rendered by the template: joined when it re-tokenizes the same, else split)."""
    messages = [{"role": "user", "content": row["question"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages,
                                                 max_tokens=6, temperature=1.0)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "again"}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return 0.5


def summarise(client, row):
    """Two calls on unrelated prompts: the second does not extend the first (two rows)."""
    client.completions.create(model="policy", prompt=row["prompt_ids"], max_tokens=4)
    client.completions.create(model="policy", prompt=row["other_ids"], max_tokens=4)
    return 1.0


def raises(client, row):
    client.completions.create(model="policy", prompt=row["prompt_ids"], max_tokens=3)
    raise RuntimeError("tool crashed")


async def hangs(client, row):
    await asyncio.sleep(60)
    return 1.0


def sleeps(client, row):
    time.sleep(30)
    return 1.0


def not_a_reward(client, row):
    return "great"


def wrong_signature(row):
    return 1.0


class AsyncAgent:
    """A workflow object whose ``__call__`` is async (an agent holding its own settings)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens

    async def __call__(self, client, row):
        reply = await client.completions.create(model="policy", prompt=row["prompt_ids"],
                                                max_tokens=self.max_tokens, temperature=1.0)
        return float(len(reply.choices[0].token_ids) > 0)


async_agent = AsyncAgent(max_tokens=3)


def yields_reward(client, row):
    client.completions.create(model="policy", prompt=row["prompt_ids"], max_tokens=3)
    yield 1.0


async def async_yields_reward(client, row):
    yield 1.0


class YieldingAgent:
    def __call__(self, client, row):
        yield 1.0


yielding_agent = YieldingAgent()


def returns_a_coroutine(client, row):
    """A plain function handing back an async helper's coroutine unawaited."""
    return chat_twice(client, row)


def never_calls(client, row):
    """Builds no request through its client (as a workflow with a client of its own would)."""
    return 1.0


def low_temperature(client, row):
    """One call at temperature 0.3, whatever ppo.temperature is."""
    client.completions.create(model="policy", prompt=row["prompt_ids"], max_tokens=3,
                              temperature=0.3)
    return 1.0


_calls = {"n": 0}
_calls_lock = __import__("threading").Lock()


def every_other(client, row):
    """A call on every other episode of the process (the others make none: errors)."""
    with _calls_lock:
        _calls["n"] += 1
        call = _calls["n"] % 2 == 0
    if call:
        client.completions.create(model="policy", prompt=row["prompt_ids"], max_tokens=3,
                                  temperature=1.0)
    return 1.0


_seen: dict = {}


def first_fails(client, row):
    """One call; the first episode of each data row of the process then raises, the others
    score 1."""
    client.completions.create(model="policy", prompt=row["prompt_ids"], max_tokens=4,
                              temperature=1.0)
    with _calls_lock:
        k = _seen.get(row["prompt"], 0)
        _seen[row["prompt"]] = k + 1
    if k == 0:
        raise RuntimeError(f"boom on {row['prompt']!r}")
    return 1.0


def logged_retry(client, row):
    """examples/workflows.py's check_and_retry, each episode's data row appended to the file
    $FSDPFN_TEST_WF_LOG names (the episodes a run started, trained or not)."""
    with open(os.environ["FSDPFN_TEST_WF_LOG"], "a") as f:
        f.write(json.dumps(row["prompt_ids"]) + "\n")
    path = Path(__file__).resolve().parents[2] / "examples" / "workflows.py"
    spec = importlib.util.spec_from_file_location("fsdpfn_examples_workflows", path)
    examples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(examples)
    return examples.check_and_retry(client, row)
