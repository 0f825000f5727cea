"""generate(): sample from a rollout server (fsdpfn.rollout, or an SGLang server: the request is
SGLang's /generate) from a training loop, with a typed error naming the server and what went
wrong.

The request asks for fsdpfn's own answer, packed (``"return_format": "fsdpfn_packed"``: token
ids and log-probs as bytes, the version of every token as runs; fsdpfn/rollout/packing.py), and
returns it as plain lists; a server that ignores that key (SGLang) answers in SGLang's shape,
which is read back into the same value (``from_sglang``)."""

from __future__ import annotations

import math
import operator
from typing import Sequence

from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.rollout import packing

__all__ = ["generate", "from_sglang", "check_prompts", "check_counts"]


def check_prompts(prompts) -> list[list[int]]:
    """``prompts`` as lists of ints: a non-empty list of non-empty token id lists (ids >= 0);
    else ConfigError naming the prompt (its index in ``prompts``) and the value."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError(f"prompts: must be a non-empty list of non-empty token id lists, got "
                          f"{str(prompts)[:80]}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not p:
            raise ConfigError(f"prompts[{i}]: must be a non-empty list of token ids (ints >= 0; "
                              f"text is tokenized by the caller), got {str(p)[:80]!r}")
        try:
            ids = [operator.index(t) for t in p]
        except TypeError:
            ids = None
        if ids is None or any(t < 0 for t in ids) or any(isinstance(t, bool) for t in p):
            raise ConfigError(f"prompts[{i}]: must be a list of token ids (ints >= 0), got "
                              f"{str(p)[:80]}")
        out.append(ids)
    return out


def check_counts(n, max_new_tokens) -> None:
    """``n`` samples a prompt and ``max_new_tokens``: ints >= 1, else ConfigError."""
    for key, value in (("n", n), ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}: out of range, got {value!r}")


def generate(url: str, prompts: Sequence[Sequence[int]], *, n: int = 1,
             max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int | None = None, stop_token_ids: Sequence[int] = (),
             seed: int | None = None, timeout: float = 300.0, **sampling) -> dict:
    """POST /generate: ``n`` samples per prompt (prompt-major: the samples of prompt i are
    outputs [i*n, (i+1)*n)). Returns the server's answer: {weight_version, outputs: [{
    prompt_index, output_ids, output_logprobs (the behav_logp of each sampled token),
    finish_reason}]}. temperature 0 is greedy. ``sampling``: any other sampling parameter of
    the server (min_p, stop, min_new_tokens, the penalties, ...: fsdpfn.rollout.SamplingParams),
    sent as it is for the server to check. A failure raises WeightSyncError (the server's
    message, or why it could not be reached); bad arguments raise ConfigError."""
    from fsdpfn.wire.http import call

    prompts = check_prompts(prompts)
    check_counts(n, max_new_tokens)
    for key, value, ok in (("temperature", temperature, 0.0 <= float(temperature) < math.inf),
                           ("top_p", top_p, 0.0 < float(top_p) <= 1.0),
                           ("timeout", timeout, float(timeout) > 0.0)):
        if not ok:
            raise ConfigError(f"{key}: out of range, got {value!r}")
    params = {**sampling, "n": n, "max_new_tokens": max_new_tokens,
              "temperature": float(temperature), "top_p": float(top_p),
              "stop_token_ids": [int(t) for t in stop_token_ids]}
    if top_k is not None:
        params["top_k"] = int(top_k)
    if seed is not None:
        params["sampling_seed"] = int(seed)
    answer = call(url, "/generate", {"input_ids": prompts,
                                     "sampling_params": params, "return_logprob": True,
                                     "return_format": "fsdpfn_packed"}, timeout=float(timeout))
    if isinstance(answer, dict) and "outputs" in answer:
        if "output_logprobs" not in answer:  # a server that answers "fsdpfn" unpacked
            return answer
        try:
            return packing.unpack(answer)
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightSyncError(f"server {url}: /generate answered a malformed packed "
                                  f"answer: {exc}") from None
    return from_sglang(answer, n)


def from_sglang(answer, n: int) -> dict:
    """SGLang's /generate answer (a list of {output_ids, meta_info}, prompt-major, or one such
    object) as {weight_version, outputs: [...]}; weight_version is the smallest served version
    named (an int when the server's versions are), else None."""
    items = answer if isinstance(answer, list) else [answer]
    outputs, versions = [], []
    for i, item in enumerate(items):
        meta = item.get("meta_info") or {}
        triples = meta.get("output_token_logprobs") or []
        reason = (meta.get("finish_reason") or {}).get("type")
        outputs.append({"prompt_index": i // n, "output_ids": [int(t[1]) for t in triples]
                        or list(item.get("output_ids") or []),
                        "output_logprobs": [float(t[0]) for t in triples],
                        "finish_reason": "length" if reason == "length" else "stop"})
        version = meta.get("weight_version")
        if isinstance(version, (int, str)) and str(version).isdigit():
            versions.append(int(version))
    return {"weight_version": min(versions) if versions else None, "outputs": outputs}
