"""generate(): sample from a rollout server (fsdpfn.rollout, or an SGLang server: the request is
SGLang's /generate) from a training loop, with a typed error naming the server and what went
wrong.

The request asks for fsdpfn's own answer, packed (``"return_format": "fsdpfn_packed"``: token
ids and log-probs as bytes, the version of every token as runs; fsdpfn/rollout/packing.py), and
returns it as plain lists; a server that ignores that key (SGLang) answers in SGLang's shape,
which is read back into the same value (``from_sglang``)."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Sequence

from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.rollout import packing

__all__ = ["generate", "from_sglang", "check_prompts", "check_counts", "check_request"]


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
            raise ConfigError(f"{key}: must be an int >= 1, got {value!r}")


def _plain(value):
    """A numpy or torch scalar as the Python int or float it holds; anything else as given (the
    rules then say why it is refused: a bool, a string, 1.9 as a seed)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    try:
        return operator.index(value)
    except TypeError:
        return float(value) if isinstance(value, numbers.Real) else value


MAX_NEW_TOKENS = 128  # generate's default, which a RolloutStream's requests share


def check_request(*, n, max_new_tokens, seed=None, timeout=300.0, **sampling) -> dict:
    """The request's sampling parameters as sent to the server (``seed`` as SGLang's
    ``sampling_seed``), each checked by the server's own rule (fsdpfn.rollout.SamplingParams)
    before anything is sent: a ConfigError names the key, the rule and the value. Values are
    sent as given, never rounded (a seed of 1.9 is refused, not read as 1). Keys the built-in
    server does not define go unchecked, for the server to judge (an SGLang server has more)."""
    from fsdpfn.rollout.errors import UpdateError
    from fsdpfn.rollout.sampling import SamplingParams

    check_counts(n, max_new_tokens)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
            or not 0 < float(timeout) < math.inf:
        raise ConfigError(f"timeout: must be a finite number of seconds > 0, got {timeout!r}")
    params = {k: ([_plain(t) for t in v] if k == "stop_token_ids" and hasattr(v, "__iter__")
                  and not isinstance(v, (str, bytes, dict)) else _plain(v))
              for k, v in sampling.items()}
    seed = _plain(seed)
    known = {k: v for k, v in params.items() if k in SamplingParams.FIELDS}
    try:
        SamplingParams(**known, n=n, max_new_tokens=max_new_tokens, seed=seed)
    except UpdateError as exc:
        raise ConfigError(str(exc).removeprefix("sampling_params.")) from None
    params.update(n=n, max_new_tokens=max_new_tokens)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def generate(url: str, prompts: Sequence[Sequence[int]], *, n: int = 1,
             max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int | None = None, stop_token_ids: Sequence[int] = (),
             seed: int | None = None, timeout: float = 300.0, rid: str | None = None,
             **sampling) -> dict:
    """POST /generate: ``n`` samples per prompt (prompt-major: the samples of prompt i are
    outputs [i*n, (i+1)*n)). Returns the server's answer: {weight_version, outputs: [{
    prompt_index, output_ids, output_logprobs (the behav_logp of each sampled token),
    finish_reason ("stop", "length", or "abort": ended early by the server's /abort_request,
    with the tokens it had)}]}. temperature 0 is greedy. ``sampling``: any other sampling
    parameter of the server (min_p, stop, min_new_tokens, the penalties, ...:
    fsdpfn.rollout.SamplingParams), sent as it is for the server to check. A failure raises WeightSyncError (the server's
    message, or why it could not be reached); bad arguments raise ConfigError. ``rid``: the
    request's name, which the server's /abort_request takes to end its outputs early."""
    from fsdpfn.wire.http import call

    prompts = check_prompts(prompts)
    if rid is not None and not isinstance(rid, str):
        raise ConfigError(f"rid: must be a string or None, got {rid!r}"[:200])
    if "sampling_seed" in sampling:
        raise ConfigError("sampling_seed: pass it as seed=, got sampling_seed="
                          f"{sampling['sampling_seed']!r}")
    params = check_request(n=n, max_new_tokens=max_new_tokens, seed=seed, timeout=timeout,
                           **sampling, temperature=temperature, top_p=top_p,
                           stop_token_ids=stop_token_ids,
                           **({} if top_k is None else {"top_k": top_k}))
    answer = call(url, "/generate", {"input_ids": prompts,
                                     "sampling_params": params, "return_logprob": True,
                                     "return_format": "fsdpfn_packed",
                                     **({} if rid is None else {"rid": rid})},
                  timeout=float(timeout))
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
                        "finish_reason": reason if reason in ("length", "abort") else "stop"})
        version = meta.get("weight_version")
        if isinstance(version, (int, str)) and str(version).isdigit():
            versions.append(int(version))
    return {"weight_version": min(versions) if versions else None, "outputs": outputs}
