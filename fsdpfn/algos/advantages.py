"""compute_advantages: pure, rank-local advantage estimation (no state).

estimator:
- ``grpo``: (r − mean(group)) / (std(group) + eps), broadcast to the row's loss tokens;
- ``drgrpo``: r − mean(group) (no std division);
- ``rloo``: r − mean of the other rows of the group;
- ``reinforce++``: token rewards (outcome at the last loss token, minus kl_coef·KL per token),
  discounted returns-to-go, whitened over the batch's loss tokens;
- ``gae``: token rewards (outcome + optional dense ``token_rewards`` − kl_coef·KL) and the critic's
  ``values`` through GAE(gamma, lam).
For the group estimators, kl_coef > 0 subtracts the KL penalty's return-to-go from each token's
advantage. ``returns`` is what a critic regresses on (GAE), or the advantages themselves.
"""

from __future__ import annotations

import torch

from fsdpfn import keys as K
from fsdpfn.batch import validate_batch
from fsdpfn.config import AdvantageConfig
from fsdpfn.errors import ConfigError
from fsdpfn.ops import gae, group_advantages, kl, kl_in_reward, scale_rewards, whiten

__all__ = ["compute_advantages"]


def _policy_logp(batch) -> str:
    return K.OLD_LOGP if K.OLD_LOGP in batch.keys() else K.LOGP


def _returns_to_go(x: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    adv, _ = gae(x, torch.zeros_like(x), mask, gamma=gamma, lam=1.0)
    return adv


def _require(batch, config: AdvantageConfig) -> tuple[tuple[str, ...], dict]:
    require = [K.LOSS_MASK, K.REWARDS]
    why = {K.REWARDS: f"estimator {config.estimator!r}"}
    if config.estimator == "gae":
        require.append(K.VALUES)
        why[K.VALUES] = "GAE; compute them with compute_values(critic, batch)"
    if config.kl_coef > 0:
        require += [K.REF_LOGP, _policy_logp(batch)]
        why[K.REF_LOGP] = f"the KL penalty (kl_coef={config.kl_coef})"
        why[_policy_logp(batch)] = f"the KL penalty (kl_coef={config.kl_coef})"
    return tuple(require), why


def compute_advantages(batch, config: AdvantageConfig):
    """New TensorDict with ``advantages`` [B, T] and ``returns`` [B, T] (0 off the loss mask)."""
    if not isinstance(config, AdvantageConfig):
        raise ConfigError(f"config: must be an AdvantageConfig, got {type(config).__name__}")
    require, why = _require(batch, config)
    group = config.group_size if config.estimator in ("grpo", "drgrpo", "rloo") else None
    validate_batch(batch, require=require, group_size=group, why=why)
    mask = batch[K.LOSS_MASK]
    rewards = scale_rewards(batch[K.REWARDS], scale=config.reward_scale, bias=config.reward_bias,
                            clip=config.reward_clip)
    penalty = None
    if config.kl_coef > 0:
        penalty = config.kl_coef * kl(batch[_policy_logp(batch)], batch[K.REF_LOGP],
                                      config.kl_kind)
        penalty = torch.where(mask, penalty, torch.zeros(()))
    if group is not None:
        per_row = group_advantages(rewards, config.group_size,
                                   norm_std=config.estimator == "grpo",
                                   leave_one_out=config.estimator == "rloo", eps=config.eps)
        adv = torch.where(mask, per_row[:, None].expand_as(mask), torch.zeros(()))
        if penalty is not None:
            adv = adv - _returns_to_go(penalty, mask, 1.0)
        returns = adv
    else:
        dense = batch[K.TOKEN_REWARDS] if K.TOKEN_REWARDS in batch.keys() else None
        logp = batch[_policy_logp(batch)] if penalty is not None else torch.zeros(mask.shape)
        ref = batch[K.REF_LOGP] if penalty is not None else torch.zeros(mask.shape)
        token_rewards = kl_in_reward(dense, rewards, logp, ref, mask, coef=config.kl_coef,
                                     kind=config.kl_kind)
        if config.estimator == "gae":
            adv, returns = gae(token_rewards, batch[K.VALUES], mask, gamma=config.gamma,
                               lam=config.lam)
        else:  # reinforce++
            returns = _returns_to_go(token_rewards, mask, config.gamma)
            adv = whiten(returns, mask)
    if config.whiten and config.estimator != "reinforce++":
        adv = whiten(adv, mask)
    out = batch.copy()
    out.set(K.ADVANTAGES, adv.float().contiguous())
    out.set(K.RETURNS, returns.float().contiguous())
    return out
