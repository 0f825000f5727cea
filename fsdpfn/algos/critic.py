"""Critic (value model) update with value clipping."""

from __future__ import annotations

from fsdpfn import keys as K
from fsdpfn.algos.common import (AGG_NORMALIZER, check_config, minibatch_seed, present,
                                 token_mean_stat)
from fsdpfn.config import CriticConfig
from fsdpfn.ops import aggregate_sum, value_loss_terms
from fsdpfn.engine.objective import Objective
from fsdpfn.engine.step import StepContext, grad_step

__all__ = ["critic_loss_fn", "critic_loss", "critic_step", "critic_objective"]


def critic_loss_fn(config: CriticConfig):
    """½·max((v−R)², (clip(v, v_old±clip)−R)²); old values from ``old_values`` or ``values``."""

    def loss_fn(outputs, mb, ctx: StepContext):
        mask = mb[K.LOSS_MASK]
        values = outputs[K.VALUES]
        clip = config.value_clip
        old = (values.detach() if clip is None  # no clipping: the old values are not read
               else mb[K.OLD_VALUES] if present(mb, K.OLD_VALUES) else mb[K.VALUES])
        terms = value_loss_terms(values, old, mb[K.RETURNS], mask, clip=clip)
        loss_sum, _ = aggregate_sum(terms.loss, mask, config.agg)
        return loss_sum, {"vf_clip_frac": token_mean_stat(terms.clipped, mask, ctx),
                          "value_mean": token_mean_stat(values, mask, ctx),
                          "returns_mean": token_mean_stat(mb[K.RETURNS], mask, ctx)}

    return loss_fn


critic_loss = critic_loss_fn  # the factory's former name, kept for callers


def critic_objective(config: CriticConfig, *, old_key: str = K.OLD_VALUES) -> Objective:
    """The critic's loss; ``old_key``: where the values before the update are (old_values, or
    values from compute_values), read only for value clipping (``value_clip`` not None)."""
    check_config(config, CriticConfig)
    why = {K.RETURNS: "the value target; compute it with compute_advantages",
           old_key: f"value clipping (value_clip={config.value_clip}) around the values before "
                    f"the update: old_values, or values from compute_values"}
    require = (K.LOSS_MASK, K.RETURNS) + ((old_key,) if config.value_clip is not None else ())
    return Objective(critic_loss_fn(config), normalizer=AGG_NORMALIZER[config.agg],
                     require=require, why=why, name="critic_step", critic=True, config=config)


def critic_step(state, batch, config: CriticConfig, *, mb_spec=None):
    """Critic update (critic states): needs returns, and with ``value_clip`` the values before
    the update (``old_values``, or ``values`` from compute_values). ``mb_spec`` overrides the
    state's micro-batching for this call."""
    old_key = K.VALUES if present(batch, K.VALUES) and not present(batch, K.OLD_VALUES) \
        else K.OLD_VALUES
    objective = critic_objective(config, old_key=old_key)
    return grad_step(state, batch, objective, optimizer_steps=config.n_minibatches,
                     shuffle_seed=minibatch_seed(state, shuffle=config.shuffle,
                                                 seed=config.seed), mb_spec=mb_spec)
