"""Helpers shared by the algorithms' loss functions."""

from __future__ import annotations

import torch

from fsdpfn.errors import ConfigError
from fsdpfn.engine.step import StepContext
from fsdpfn.validators import derived_seed

AGG_NORMALIZER = {"token-mean": "tokens", "seq-mean-token-sum": "sequences",
                  "seq-mean-token-mean": "sequences"}


def token_mean_stat(x: torch.Tensor, mask: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """A per-token statistic's contribution such that, after the engine divides by the step's
    normaliser and sums over micro-batches and ranks, it is the global token mean of ``x``."""
    total = torch.where(mask, x.float(), torch.zeros((), device=x.device)).sum().detach()
    return total * (ctx.denominator / max(ctx.n_tokens, 1))


def present(batch, key: str) -> bool:
    return key in batch.keys()


def minibatch_seed(state, *, shuffle: bool, seed: int) -> int | None:
    """grad_step's shuffle_seed for one call: None (rows in order), or one drawn from (seed,
    state.step), so every call shuffles the global batch differently but reproducibly."""
    return derived_seed(seed, state.step) if shuffle else None


def check_config(config, cls) -> None:
    if not isinstance(config, cls):
        raise ConfigError(f"config: must be a{'n' if cls.__name__[0] in 'AEIOSR' else ''} "
                          f"{cls.__name__}, got {type(config).__name__}")
