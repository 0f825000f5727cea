"""generate(): sample from a rollout server (fsdpfn.rollout, or anything answering its /generate)
from a training loop, with a typed error naming the server and what went wrong."""

from __future__ import annotations

from typing import Sequence

from fsdpfn.errors import ConfigError

__all__ = ["generate"]


def generate(url: str, prompts: Sequence[Sequence[int]], *, n: int = 1,
             max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int | None = None, stop_token_ids: Sequence[int] = (),
             seed: int | None = None, timeout: float = 300.0) -> dict:
    """POST /generate: ``n`` samples per prompt (prompt-major: the samples of prompt i are
    outputs [i*n, (i+1)*n)). Returns the server's answer: {weight_version, outputs: [{
    prompt_index, output_ids, output_logprobs (the behav_logp of each sampled token),
    finish_reason}]}. temperature 0 is greedy. A failure raises WeightSyncError (the server's
    message, or why it could not be reached); bad arguments raise ConfigError."""
    from fsdpfn.weights.http import call

    if not isinstance(prompts, Sequence) or not prompts or not all(
            isinstance(p, Sequence) and len(p) > 0 for p in prompts):
        raise ConfigError(f"prompts: must be a non-empty list of non-empty token id lists, got "
                          f"{str(prompts)[:80]}")
    for key, value, ok in (("n", n, isinstance(n, int) and n >= 1),
                           ("max_new_tokens", max_new_tokens,
                            isinstance(max_new_tokens, int) and max_new_tokens >= 1),
                           ("temperature", temperature, float(temperature) >= 0.0),
                           ("top_p", top_p, 0.0 < float(top_p) <= 1.0),
                           ("timeout", timeout, float(timeout) > 0.0)):
        if not ok:
            raise ConfigError(f"{key}: out of range, got {value!r}")
    sampling = {"n": n, "max_new_tokens": max_new_tokens, "temperature": float(temperature),
                "top_p": float(top_p), "stop_token_ids": [int(t) for t in stop_token_ids]}
    if top_k is not None:
        sampling["top_k"] = int(top_k)
    if seed is not None:
        sampling["seed"] = int(seed)
    return call(url, "/generate", {"input_ids": [[int(t) for t in p] for p in prompts],
                                   "sampling_params": sampling}, timeout=float(timeout))
