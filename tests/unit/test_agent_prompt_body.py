"""An episode client sends a completion's prompt as openai's own client does, without checking
it token by token: the same request body for every form the field takes (ids, lists of ids,
texts, a text, any iterable), with ``extra_body`` merged as openai merges it. The plain
``openai.OpenAI`` client on the same answers is the reference."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from fsdpfn.rollout.agent import AsyncEpisodeClient, EpisodeClient, call_seed  # noqa: E402


def _answer(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    prompt = body["prompt"]
    ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    nested = isinstance(prompt, list) and prompt and isinstance(prompt[0], list)
    rows = prompt if nested else [prompt if ids else [1]]
    choices = [{"index": i, "text": "ab", "finish_reason": "length", "logprobs": None,
                "prompt_token_ids": row or [1], "token_ids": [5, 6],
                "token_logprobs": [-0.5, -0.25], "weight_versions": [0, 0], "weight_version": 0,
                "temperature": 1.0}
               for i, row in enumerate(rows)]
    return httpx.Response(200, json={"id": "c", "object": "text_completion", "created": 0,
                                     "model": "policy", "choices": choices})


def _bodies(sent: list) -> list[dict]:
    return [json.loads(r.content) for r in sent]


CASES = {
    "ids": dict(prompt=[3, 1, 4, 1, 5, 9, 2, 6]),
    "ids as a tuple": dict(prompt=(3, 1, 4)),
    "ids from a generator": lambda: dict(prompt=(t for t in [7, 8, 9])),  # fresh each call
    "lists of ids": dict(prompt=[[1, 2, 3], [4, 5]]),
    "lists of ids as tuples": dict(prompt=[(1, 2, 3), (4, 5)]),
    "texts": dict(prompt=["a b", "c"]),
    "a text": dict(prompt="a b c"),
    "ids with extra_body": dict(prompt=[1, 2], extra_body={"stop_token_ids": [2], "top_k": 4}),
    "extra_body's own prompt wins": dict(prompt=[1, 2], extra_body={"prompt": [9, 9, 9]}),
    "empty ids": dict(prompt=[]),
    "a mapping (sent as openai sends it)": dict(prompt={"a": 1}),
    # (a mapping inside a list is sent as it is by openai 3.63 and as its keys by 1.30: the
    # server refuses either, and the client follows 3.63)
    "bytes": dict(prompt=b"ab"),
}


def _recording(sent: list) -> httpx.MockTransport:
    def handler(request):
        sent.append(request)
        return _answer(request)
    return httpx.MockTransport(handler)


def _plain_sync(sent):
    return openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", max_retries=0,
                         http_client=httpx.Client(transport=_recording(sent)))


def _ours(cls, sent, seed=None):
    client = cls("http://127.0.0.1:9", seed=seed)
    client._client._transport.inner = _recording(sent)  # under the seeding transport
    return client


def _call(case):
    kwargs = case() if callable(case) else case
    return dict(model="policy", max_tokens=2, temperature=1.0, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_the_sync_client_sends_openais_body(case):
    ref, ours = [], []
    _plain_sync(ref).completions.create(**_call(CASES[case]))
    client = _ours(EpisodeClient, ours)
    out = client.completions.create(**_call(CASES[case]))
    assert _bodies(ours) == _bodies(ref)
    assert [c.text for c in out.choices] == ["ab"] * len(out.choices)
    assert len(client.turns) == len(out.choices)


@pytest.mark.parametrize("case", list(CASES))
def test_the_async_client_sends_openais_body(case):
    ref, ours = [], []
    _plain_sync(ref).completions.create(**_call(CASES[case]))

    async def go():
        client = _ours(AsyncEpisodeClient, ours)
        out = await client.completions.create(**_call(CASES[case]))
        await client.close()
        return client, out

    client, out = asyncio.run(go())
    assert _bodies(ours) == _bodies(ref)
    assert len(client.turns) == len(out.choices)


def test_raw_response_and_seeds_go_the_same_way():
    ours = []
    client = _ours(EpisodeClient, ours, seed=11)
    raw = client.completions.with_raw_response.create(**_call(CASES["ids"]))
    client.with_raw_response.completions.create(**_call(CASES["ids with extra_body"]))
    assert raw.parse().choices[0].text == "ab"
    bodies = _bodies(ours)
    assert bodies[0]["prompt"] == CASES["ids"]["prompt"]
    assert [b["seed"] for b in bodies] == [call_seed(11, 0), call_seed(11, 1)]
    assert bodies[1]["stop_token_ids"] == [2] and bodies[1]["prompt"] == [1, 2]
    assert len(client.turns) == 2


def test_a_bad_prompt_is_refused_as_openai_refuses_it():
    """Neither client can send what JSON cannot hold; both fail before a request is made."""
    ref, ours = [], []
    bad = dict(prompt=[1, object()])
    with pytest.raises(TypeError) as plain:
        _plain_sync(ref).completions.create(**_call(bad))
    with pytest.raises(TypeError) as mine:
        _ours(EpisodeClient, ours).completions.create(**_call(bad))
    assert ref == ours == []
    assert "JSON serializable" in str(plain.value) and "JSON serializable" in str(mine.value)
