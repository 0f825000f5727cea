"""Supervised fine-tuning: −log-likelihood of the loss_mask tokens."""

from __future__ import annotations

from fsdpfn import keys as K
from fsdpfn.algos.common import AGG_NORMALIZER, check_config
from fsdpfn.config import SFTConfig
from fsdpfn.engine.objective import Objective
from fsdpfn.ops import sft_loss_sum
from fsdpfn.engine.step import grad_step

__all__ = ["sft_loss_fn", "sft_objective", "sft_step"]


def sft_loss_fn(config: SFTConfig):
    """loss_fn for grad_step: the summed −log π of the loss_mask tokens (ops.sft_loss_sum, with
    ``config.agg``); grad_step divides it by the global count."""

    def loss_fn(outputs, mb, ctx):
        nll_sum, _ = sft_loss_sum(outputs[K.LOGP], mb[K.LOSS_MASK], agg=config.agg)
        return nll_sum, {}

    return loss_fn


def sft_objective(config: SFTConfig = SFTConfig()) -> Objective:
    check_config(config, SFTConfig)
    return Objective(sft_loss_fn(config), normalizer=AGG_NORMALIZER[config.agg], name="sft_step",
                     critic=False, config=config)


def sft_step(state, batch, config: SFTConfig = SFTConfig(), *, mb_spec=None):
    """One optimizer step on −mean log π(loss_mask tokens); ``mb_spec`` overrides the state's
    micro-batching for this call."""
    return grad_step(state, batch, sft_objective(config), mb_spec=mb_spec)
