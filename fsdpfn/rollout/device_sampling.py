"""Token draws of the decode loop (fsdpfn/rollout/decode.py), on the device, no host sync.

Each row draws by the exponential race: argmax of p / E with E ~ Exp(1), which is a draw from p,
and computed as argmax(log p - log E) over the (truncated) scaled logits. Greedy rows take the
argmax of the logits. A seeded row draws its E from an integer hash of (seed, step, token id), so
its tokens do not depend on what else is batched. Log-probs follow the engine's ``behav_logp``
convention: log_softmax(logits / T) at the drawn token, top-p / top-k truncation not applied.
"""

from __future__ import annotations

import torch

from fsdpfn.rollout.sampling import prompt_seed

__all__ = ["sample", "row_seed", "seeded_exponential"]


def sample(logits, temperature, top_p, top_k, *, truncate: bool, seeds=None, steps=None):
    """logits[R, V] float32, per-row temperature / top_p / top_k [R] -> (token[R], logp[R]).
    Sampling by the exponential race (argmax of p / E, E ~ Exp(1)): no host sync. Greedy rows
    (temperature <= 0) take the argmax of the logits and report log_softmax(logits). Rows with
    a seed (``seeds`` [R] >= 0, ``steps`` [R] the index of the token drawn) draw E from a hash
    of (seed, step, token id): the same seed gives the same tokens whatever else is batched."""
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    filtered = _truncate(scaled, top_p, top_k) if truncate else scaled
    noise = torch.empty_like(scaled).exponential_()
    if seeds is not None:
        noise = torch.where((seeds >= 0)[:, None], seeded_exponential(seeds, steps, scaled),
                            noise)
    race = filtered - noise.log()
    token = torch.where(greedy, logits.argmax(-1), race.argmax(-1))
    logp = scaled.gather(-1, token[:, None])[:, 0] - torch.logsumexp(scaled, -1)
    return token, logp


_MASK = 0x7FFFFFFF  # 31-bit lanes: every product below fits in int64


def seeded_exponential(seeds, steps, like):
    """Exp(1) draws [R, V] from an integer hash of (seed, step, column), device ops only."""
    column = torch.arange(like.shape[-1], device=like.device)
    x = ((seeds[:, None] & _MASK) * 7919 + (steps[:, None] & _MASK) * 104729 + column) & _MASK
    for _ in range(3):
        x = (x * 1103515245 + 12345) & _MASK
        x = x ^ (x >> 13)
    return -torch.log(_uniform(x))


def _uniform(x):
    """31-bit hash states -> float32 uniforms strictly inside (0, 1): their top 23 bits k as
    (k + 0.5) / 2**23, exact in float32. With all 31 bits, k + 0.5 rounded to 2**31 for the top
    64 states: u = 1, a draw of 0 that won the race whatever its logit (a token outside top-k,
    of p 3e-8), on one seeded step in about 200 at a 152k vocabulary."""
    return ((x >> 8).to(torch.float32) + 0.5) / float(2**23)


def row_seed(seed: int | None, prompt: int, sample: int) -> int:
    """The seed of sample ``sample`` of prompt ``prompt`` of a request seeded with ``seed``
    (-1: unseeded): the prompt's own seed (prompt_seed), mixed with the sample's index."""
    if seed is None:
        return -1
    return (prompt_seed(seed, prompt) * 1000003 + sample) & _MASK


def _truncate(scaled, top_p, top_k):
    """-inf outside each row's top-k, then outside the smallest set holding top_p of the mass
    (HF's order: top-k, then top-p; the most likely token is always kept)."""
    values, index = scaled.sort(-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    keep = ranks[None] < torch.where(top_k > 0, top_k, scaled.shape[-1])[:, None]
    probs = values.masked_fill(~keep, float("-inf")).softmax(-1)
    keep &= (probs.cumsum(-1) - probs) < top_p[:, None]
    return torch.full_like(scaled, float("-inf")).scatter(
        -1, index, values.masked_fill(~keep, float("-inf")))
