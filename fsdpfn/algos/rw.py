"""Reward model: Bradley-Terry on the score at each row's last token (rows 2i chosen, 2i+1
rejected). Runs on critic states (a scalar head)."""

from __future__ import annotations

import torch

from fsdpfn import keys as K
from fsdpfn.algos.common import check_config
from fsdpfn.config import RWConfig
from fsdpfn.engine.objective import Objective
from fsdpfn.ops import bradley_terry_loss_sum
from fsdpfn.engine.step import grad_step

__all__ = ["rw_loss_fn", "rw_loss", "rw_step", "last_token_scores", "rw_objective"]


def last_token_scores(scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """scores[B, T] -> [B]: each row's score at its last real token."""
    last = attention_mask.long().sum(-1) - 1
    return scores.gather(-1, last.clamp(min=0)[:, None]).squeeze(-1)


def rw_loss_fn(config: RWConfig):
    """loss_fn for grad_step: ops.bradley_terry_loss_sum (with ``config.margin``) on the scores at
    each pair's last tokens; grad_step divides by the global pair count."""

    def loss_fn(outputs, mb, ctx):
        s = last_token_scores(outputs["scores"], mb[K.ATTENTION_MASK]).view(-1, 2)  # (pairs, 2)
        loss_sum, stats = bradley_terry_loss_sum(s[:, 0], s[:, 1], margin=config.margin)
        return loss_sum, {**stats, "chosen_score": s[:, 0].detach().sum(),
                          "rejected_score": s[:, 1].detach().sum()}

    return loss_fn


rw_loss = rw_loss_fn  # the factory's former name, kept for callers


def rw_objective(config: RWConfig = RWConfig()) -> Objective:
    check_config(config, RWConfig)
    return Objective(rw_loss_fn(config), normalizer="pairs", require=(), group_size=2, pairs=True,
                     name="rw_step", critic=True, config=config)


def rw_step(state, batch, config: RWConfig = RWConfig(), *, mb_spec=None):
    """One optimizer step of the pairwise loss, normalised by the global number of pairs;
    ``mb_spec`` overrides the state's micro-batching for this call."""
    return grad_step(state, batch, rw_objective(config), mb_spec=mb_spec)
