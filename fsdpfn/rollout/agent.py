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
"""

from __future__ import annotations

import json

import httpx
import openai

from fsdpfn.errors import WeightSyncError
from fsdpfn.rollout.episode import Turn

__all__ = ["EpisodeClient", "AsyncEpisodeClient", "turns_of"]

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


class EpisodeClient(openai.OpenAI):
    """``openai.OpenAI`` on a rollout server; ``turns`` holds every completion made (module doc).
    ``timeout``: seconds per request."""

    def __init__(self, url: str, *, timeout: float = 300.0, **kwargs):
        self.turns: list[Turn] = []
        self.server_url = url
        http = httpx.Client(timeout=timeout, event_hooks={"response": [self._record]})
        super().__init__(base_url=_base(url), api_key="fsdpfn", http_client=http, max_retries=0,
                         **kwargs)

    def _record(self, response: httpx.Response) -> None:
        if _recorded(response.request) and response.status_code == 200:
            response.read()
            self.turns.extend(turns_of(self.server_url, _answer(response)))


class AsyncEpisodeClient(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` on a rollout server, recording like EpisodeClient."""

    def __init__(self, url: str, *, timeout: float = 300.0, **kwargs):
        self.turns: list[Turn] = []
        self.server_url = url
        http = httpx.AsyncClient(timeout=timeout, event_hooks={"response": [self._record]})
        super().__init__(base_url=_base(url), api_key="fsdpfn", http_client=http, max_retries=0,
                         **kwargs)

    async def _record(self, response: httpx.Response) -> None:
        if _recorded(response.request) and response.status_code == 200:
            await response.aread()
            self.turns.extend(turns_of(self.server_url, _answer(response)))
