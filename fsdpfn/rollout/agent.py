"""OpenAI clients bound to fsdpfn's rollout server that record every completion's exact tokens.

    client = EpisodeClient("http://127.0.0.1:30000")          # an openai.OpenAI
    reply = client.chat.completions.create(model="policy", messages=[...], max_tokens=256)
    client.turns                                               # [Turn(prompt_ids, output_ids, ...)]

``EpisodeClient`` is ``openai.OpenAI`` and ``AsyncEpisodeClient`` ``openai.AsyncOpenAI`` (so an
agent framework that takes an OpenAI client takes these), with an httpx response hook that reads
fsdpfn's fields of every completion choice (``prompt_token_ids``, ``token_ids``,
``token_logprobs``, ``weight_versions``, ``temperature``: the server's own ids, behav_logp,
versions and the temperature they were drawn at) into ``turns``. Nothing is re-tokenized. A
server that does not return these fields (a plain OpenAI
endpoint) is refused on the first call: its text cannot be trained on exactly.

``seed``: an episode's seed. Its completion calls that set no ``seed`` of their own are sent
``call_seed(seed, k)``, k the call's place among the client's calls (0, 1, ...), so an episode
whose calls come in a fixed order draws the same tokens again (on the same kind of device: the
server's seeded draws); a call's own ``seed`` is sent as it is, and still counts its place.
"""

from __future__ import annotations

import functools
import json
import ssl
import threading

import httpx
import openai
from openai.resources.completions import AsyncCompletions, Completions

from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.rollout.errors import SEED_END
from fsdpfn.rollout.episode import Turn
from fsdpfn.rollout.sampling import prompt_seed

__all__ = ["EpisodeClient", "AsyncEpisodeClient", "turns_of", "call_seed"]

FIELDS = ("prompt_token_ids", "token_ids", "token_logprobs", "weight_versions")
RECORDED = ("/completions", "/chat/completions")


def turns_of(url: str, body: dict) -> list[Turn]:
    """The turns of one completion answer (every choice), from fsdpfn's fields."""
    out = []
    for choice in body.get("choices") or []:
        missing = [k for k in FIELDS if k not in choice]
        if missing:
            raise WeightSyncError(f"{url}: the completion has no {missing[0]!r}: episodes need "
                                  f"the server's token ids, behav_logp and versions (fsdpfn's "
                                  f"rollout server returns them), not text")
        out.append(Turn(choice["prompt_token_ids"], choice["token_ids"], choice["token_logprobs"],
                        choice["weight_versions"], choice.get("temperature")))
    return out


def _answer(response) -> dict:
    """The JSON answer, or a streamed one's choices gathered from its chunks (fsdpfn's fields
    ride on each choice's last chunk)."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return response.json()
    choices = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[len("data: "):])
            choices += [c for c in chunk.get("choices") or [] if "token_ids" in c]
    return {"choices": choices}


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _recorded(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith(RECORDED)


def call_seed(seed: int, call: int) -> int:
    """The seed call ``call`` (0, 1, ...) of an episode seeded ``seed`` is sent with."""
    return prompt_seed(seed, call)


class _Seeds:
    """An episode's seed and its calls so far: each recorded request without a ``seed`` of its
    own is rebuilt with call_seed(seed, its place)."""

    def __init__(self, seed: int | None):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not 0 <= seed < SEED_END):
            raise ConfigError(f"seed: must be an int in [0, 2**63) or None, got {seed!r}")
        self.seed, self.calls, self.lock = seed, 0, threading.Lock()

    def apply(self, request: httpx.Request) -> httpx.Request:
        if self.seed is None or not _recorded(request):
            return request
        with self.lock:
            call, self.calls = self.calls, self.calls + 1
        try:
            body = json.loads(request.read() or b"null")
        except ValueError:
            return request  # not JSON: the server answers its 400
        if not isinstance(body, dict) or body.get("seed") is not None:
            return request
        body["seed"] = call_seed(self.seed, call)
        headers = [(k, v) for k, v in request.headers.multi_items()
                   if k.lower() != "content-length"]
        return httpx.Request(request.method, request.url, headers=headers, json=body,
                             extensions=request.extensions)


@functools.lru_cache(maxsize=None)
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every client of the process. httpx builds one per transport by
    default, loading the CA bundle each time: 20 ms a client, 10 s for a step of 512 episodes
    on a CPU core (BENCHMARKS.md, Rollout workflows)."""
    make = getattr(httpx, "create_ssl_context", None)
    return make() if make is not None else ssl.create_default_context()


class _SeedingTransport(httpx.BaseTransport):
    def __init__(self, seeds: _Seeds):
        self.seeds, self.inner = seeds, httpx.HTTPTransport(verify=_ssl_context())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(self.seeds.apply(request))

    def close(self) -> None:
        self.inner.close()


class _AsyncSeedingTransport(httpx.AsyncBaseTransport):
    def __init__(self, seeds: _Seeds):
        self.seeds, self.inner = seeds, httpx.AsyncHTTPTransport(verify=_ssl_context())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(self.seeds.apply(request))

    async def aclose(self) -> None:
        await self.inner.aclose()


def _prompt_as_body(kwargs: dict) -> dict:
    """A completion's token-id prompt sent as it is. openai's client checks every element of a
    list ``prompt`` against each of the four types the field allows before sending it unchanged:
    about 10 µs a token, 42 ms of the client's CPU for a prompt of 4,096 ids, which a multi-turn
    episode sends again at every turn (BENCHMARKS.md, "Rollout workflows"). A list or other
    iterable prompt (ids, texts, lists of ids) goes into the body through ``extra_body``, which
    the client sends as given; an ``extra_body`` ``prompt`` of the caller's own still wins."""
    prompt = kwargs.get("prompt")
    if not hasattr(prompt, "__iter__") or isinstance(prompt, (str, bytes, dict)):
        return kwargs  # what openai sends as given or turns into something else: its own way
    prompt = [list(x) if hasattr(x, "__iter__") and not isinstance(x, (str, bytes, dict, list))
              else x for x in prompt]
    return {**kwargs, "prompt": "", "extra_body": {"prompt": prompt,
                                                   **(kwargs.get("extra_body") or {})}}


class _Completions(Completions):
    def create(self, **kwargs):
        return super().create(**_prompt_as_body(kwargs))


class _AsyncCompletions(AsyncCompletions):
    async def create(self, **kwargs):
        return await super().create(**_prompt_as_body(kwargs))


class EpisodeClient(openai.OpenAI):
    """``openai.OpenAI`` on a rollout server; ``turns`` holds every completion made (module doc).
    ``timeout``: seconds per request; ``seed``: the episode's seed (module doc)."""

    def __init__(self, url: str, *, timeout: float = 300.0, seed: int | None = None,
                 **kwargs):
        self.turns: list[Turn] = []
        self.server_url = url
        http = httpx.Client(timeout=timeout, event_hooks={"response": [self._record]},
                            transport=_SeedingTransport(_Seeds(seed)))
        super().__init__(base_url=_base(url), api_key="fsdpfn", http_client=http, max_retries=0,
                         **kwargs)
        self.__dict__["completions"] = _Completions(self)

    def _record(self, response: httpx.Response) -> None:
        if _recorded(response.request) and response.status_code == 200:
            response.read()
            self.turns.extend(turns_of(self.server_url, _answer(response)))


class AsyncEpisodeClient(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` on a rollout server, recording (and seeding) like
    EpisodeClient."""

    def __init__(self, url: str, *, timeout: float = 300.0, seed: int | None = None,
                 **kwargs):
        self.turns: list[Turn] = []
        self.server_url = url
        http = httpx.AsyncClient(timeout=timeout, event_hooks={"response": [self._record]},
                                 transport=_AsyncSeedingTransport(_Seeds(seed)))
        super().__init__(base_url=_base(url), api_key="fsdpfn", http_client=http, max_retries=0,
                         **kwargs)
        self.__dict__["completions"] = _AsyncCompletions(self)

    async def _record(self, response: httpx.Response) -> None:
        if _recorded(response.request) and response.status_code == 200:
            await response.aread()
            self.turns.extend(turns_of(self.server_url, _answer(response)))
