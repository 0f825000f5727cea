"""The seeded draw's uniforms lie strictly inside (0, 1) for every hash state.

Computed from all 31 bits in float32, the top 64 states rounded to u = 1: an Exp(1) draw of 0,
so -log E = +inf, and that column won the race whatever its logit (a token of probability 3e-8
outside top-k was returned; a truncated one scored NaN, which argmax picks). Two seeds that
hit it, found by scanning the old hash, are checked below at their columns.
"""

from __future__ import annotations

import torch

from fsdpfn.rollout.device_sampling import _MASK, _uniform, row_seed, seeded_exponential


def test_every_hash_state_is_a_uniform_strictly_inside_zero_one():
    edges = torch.tensor([0, 1, 255, 256, _MASK - 256, _MASK - 1, _MASK], dtype=torch.int64)
    u = _uniform(edges)
    assert u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all()), u.tolist()
    noise = -torch.log(u)
    assert bool(torch.isfinite(noise).all()) and bool((noise > 0).all())


def test_the_seeds_that_drew_a_zero_draw_positive_finite_noise():
    like = torch.zeros(1, 259)
    for seed, column in [(144116, 13), (595958, 226)]:
        noise = seeded_exponential(torch.tensor([row_seed(seed, 0, 0)]),
                                   torch.tensor([0]), like)[0]
        assert float(noise[column]) > 0 and bool(torch.isfinite(noise).all()), (seed, column)
