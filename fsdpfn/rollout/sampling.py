"""Sampling options of the rollout server, in SGLang's names (its SamplingParams), and the pieces
the HF generate path needs for them: penalties, top log-probs, stop strings.

Conventions (SGLang's, python/sglang/srt/sampling/): penalties count the generated tokens only
(not the prompt): frequency subtracts ``frequency_penalty * count``, presence subtracts
``presence_penalty`` once a token appeared, repetition divides positive logits (multiplies
negative ones) of tokens that appeared; they act on the logits before temperature. A stop string
ends a row at the token that completes it (the string is cut from ``text``, its tokens stay in
``output_ids``); nothing stops a row before ``min_new_tokens``.

The reported log-probs stay the ``behav_logp`` convention of fsdpfn/rollout/engine.py:
log_softmax(logits / temperature) of the model, before penalties and truncation, which is what the
trainer's ``forward_logp(..., temperature=T)`` computes for the same tokens.
"""

from __future__ import annotations

import copy
import math
import operator
from typing import TYPE_CHECKING, Callable, Sequence

from fsdpfn.rollout.errors import GREEDY_BELOW, SEED_END, UpdateError

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingParams", "Penalties", "find_stop", "REFUSED"]


# SGLang sampling keys this server does not implement: refused by name when set
REFUSED = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "logit_bias",
           "custom_params")
# accepted, with no effect on a non-streaming answer
INERT = {"stream_interval": None, "spaces_between_special_tokens": True}


def _token_id(t) -> bool:
    """An int >= 0, or anything that is one (numpy or 0-d torch integers), but not a bool."""
    if isinstance(t, bool):
        return False
    try:
        return operator.index(t) >= 0
    except TypeError:
        return False




class SamplingParams:
    """temperature (0: greedy, as is any below 1e-6, SGLang's rule: dividing the logits by
    it would overflow them), top_p, top_k (0 or -1: off), min_p, max_new_tokens (16 here,
    SGLang's /generate sends its own default 128), min_new_tokens, stop_token_ids, stop (str or
    list of str), ignore_eos, n, seed (SGLang: sampling_seed), frequency_penalty,
    presence_penalty, repetition_penalty, no_stop_trim, skip_special_tokens.

    ``ignore_eos``: the engine stops only at ``stop_token_ids``; the HTTP layers add the model's
    end-of-sequence ids unless it is set (SGLang's default). ``seed``: reproducible sampling on
    both paths. Sample j of prompt i draws with row_seed(seed, i, j) (the prompt's own seed,
    prompt_seed(seed, i), mixed with j): its tokens depend on the seed, i, j and its logits,
    never on what else is batched (HF generate draws seeded rows by the decode loop's
    exponential race on the CPU; the CUDA loop by its Philox uniforms, so a seed reproduces on
    one kind of device). The decode loop refuses, by name, the penalties,
    min_new_tokens and min_p (fsdpfn.rollout.generation.check_decode)."""

    FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_new_tokens": 16,
              "min_new_tokens": 0, "stop_token_ids": (), "stop": (), "ignore_eos": False,
              "n": 1, "seed": None, "frequency_penalty": 0.0, "presence_penalty": 0.0,
              "repetition_penalty": 1.0, "no_stop_trim": False, "skip_special_tokens": True}

    def __init__(self, **kwargs):
        self._names = {}  # the key a value came under, where it differs from the field's
        if "sampling_seed" in kwargs:
            kwargs["seed"] = kwargs.pop("sampling_seed")
            self._names["seed"] = "sampling_seed"
        refused = sorted(k for k in REFUSED if kwargs.get(k) not in (None, {}, [], ""))
        if refused:
            raise UpdateError(f"sampling_params.{refused[0]}: not supported by this server "
                                f"(must be null), got {str(kwargs[refused[0]])[:80]!r}")
        unknown = sorted(set(kwargs) - set(self.FIELDS) - set(REFUSED) - set(INERT))
        if unknown:
            raise UpdateError(f"sampling_params: unknown keys {unknown}; allowed "
                                f"{sorted(self.FIELDS)} (and SGLang's sampling_seed)")
        for key, default in self.FIELDS.items():
            value = kwargs.get(key)
            setattr(self, key, default if value is None else value)
        ids, stop = self.stop_token_ids, self.stop  # "" stays "": refused below, not "none"
        if not isinstance(ids, (list, tuple)) or not all(_token_id(t) for t in ids):
            raise UpdateError(f"sampling_params.stop_token_ids: must be a list of token ids "
                              f"(ints >= 0), got {str(ids)[:80]}")
        if not isinstance(stop, (str, list, tuple)):
            raise UpdateError(f"sampling_params.stop: must be a non-empty string or a list of "
                              f"them, got {str(stop)[:80]}")
        self.stop_token_ids = [operator.index(t) for t in ids]
        self.stop = [stop] if isinstance(stop, str) else list(stop)
        if self.top_k == -1:  # SGLang's "whole vocabulary"
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def is_int(v, low):
            return isinstance(v, int) and not isinstance(v, bool) and v >= low

        def is_num(v):  # a JSON int past float's range (10**400) is no number to sample with
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                return False
            try:
                return math.isfinite(float(v))
            except OverflowError:
                return False

        # each rule runs only after the ones above it hold (min_new_tokens compares with a
        # max_new_tokens already known to be an int)
        rules = [("temperature", lambda: is_num(self.temperature)
                  and 0 <= self.temperature < math.inf, "a finite number >= 0"),
                 ("top_p", lambda: is_num(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
                 ("top_k", lambda: is_int(self.top_k, 0), "an int >= 0 (or -1: off)"),
                 ("min_p", lambda: is_num(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
                 ("max_new_tokens", lambda: is_int(self.max_new_tokens, 1), "an int >= 1"),
                 ("min_new_tokens", lambda: is_int(self.min_new_tokens, 0)
                  and self.min_new_tokens <= self.max_new_tokens, "an int in [0, max_new_tokens]"),
                 ("n", lambda: is_int(self.n, 1), "an int >= 1"),
                 ("seed", lambda: self.seed is None or is_int(self.seed, 0)
                  and self.seed < SEED_END, "null or an int in [0, 2**63)"),
                 ("frequency_penalty", lambda: is_num(self.frequency_penalty)
                  and -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
                 ("presence_penalty", lambda: is_num(self.presence_penalty)
                  and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
                 ("repetition_penalty", lambda: is_num(self.repetition_penalty)
                  and 0 < self.repetition_penalty <= 2, "in (0, 2]"),
                 ("stop", lambda: all(isinstance(s, str) and s for s in self.stop),
                  "a non-empty string or a list of them"),
                 ("ignore_eos", lambda: isinstance(self.ignore_eos, bool), "a bool"),
                 ("no_stop_trim", lambda: isinstance(self.no_stop_trim, bool), "a bool"),
                 ("skip_special_tokens", lambda: isinstance(self.skip_special_tokens, bool),
                  "a bool")]
        for key, ok, rule in rules:
            if not ok():
                raise UpdateError(f"sampling_params.{self._names.get(key, key)}: must be "
                                  f"{rule}, got {getattr(self, key)!r}")
        for key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                    "repetition_penalty"):  # a JSON int (10**30) as the float torch takes
            setattr(self, key, float(getattr(self, key)))
        if 0 < self.temperature < GREEDY_BELOW:  # logits / T would overflow to inf
            self.temperature = 0.0

    @property
    def penalized(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1)

    def capped(self, max_new_tokens: int) -> "SamplingParams":
        """A copy that generates at most ``max_new_tokens`` (min_new_tokens lowered with it)."""
        out = copy.copy(self)
        out.max_new_tokens = min(self.max_new_tokens, max_new_tokens)
        out.min_new_tokens = min(self.min_new_tokens, out.max_new_tokens)
        return out

    def with_stops(self, eos_ids: Sequence[int]) -> "SamplingParams":
        """A copy that also stops at ``eos_ids`` unless ``ignore_eos``."""
        out = copy.copy(self)
        if not self.ignore_eos:
            out.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *eos_ids]))
        return out


class Penalties:
    """An HF logits processor: frequency, presence and repetition penalties over the tokens
    generated so far (columns ``width:`` of the left-padded input ids), per SGLang."""

    def __init__(self, width: int, sp: SamplingParams):
        self.width, self.sp = width, sp

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch  # here: a recipe's config checks its sampling parameters without torch

        generated = input_ids[:, self.width:]  # (B, t)
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype))
        seen = counts > 0
        scores = scores - self.sp.frequency_penalty * counts - self.sp.presence_penalty * seen
        r = float(self.sp.repetition_penalty)
        if r != 1.0:
            scaled = torch.where(scores < 0, scores * r, scores / r)
            scores = torch.where(seen, scaled, scores)
        return scores


def find_stop(ids: list[int], decode: Callable[[list[int]], str], stops: Sequence[str],
              min_new_tokens: int = 0) -> tuple[int, str] | None:
    """(number of tokens up to and including the one that completes the first stop string, that
    string), or None when no stop string appears (none may end before ``min_new_tokens``)."""
    if not stops or not any(s in decode(ids) for s in stops):
        return None
    for end in range(max(1, min_new_tokens), len(ids) + 1):
        text = decode(ids[:end])
        hits = [s for s in stops if s in text]
        if hits:
            return end, min(hits, key=text.find)
    return None


_SEED_MASK = 0x7FFFFFFF  # the draws' seeds are 31-bit (fsdpfn.rollout.device_sampling)
_GOLDEN = 0x9E3779B1 & _SEED_MASK  # odd: the prompt seeds of one request are all distinct


def prompt_seed(seed: int, prompt: int) -> int:
    """The seed prompt ``prompt`` of a request seeded ``seed`` draws with, on both generation
    paths. Linear in the index: the request of prompts k, k+1, ... seeded prompt_seed(seed, k)
    draws what those prompts draw in the whole request, so a batch split over servers
    (fsdpfn.rollout.balance) or into a stream's requests draws the same tokens."""
    return (int(seed) + int(prompt) * _GOLDEN) & _SEED_MASK
