"""compute_advantages: pure advantage estimation (no state), rank-local or dp-global.

estimator:
- ``grpo``: (r − mean(group)) / (std(group) + eps), broadcast to the row's loss tokens;
- ``drgrpo``: r − mean(group) (no std division);
- ``rloo``: r − mean of the other rows of the group;
- ``reinforce++``: token rewards (outcome at the last loss token, plus the optional dense
  ``token_rewards``, minus kl_coef·KL per token), discounted returns-to-go, whitened over the
  batch's loss tokens;
- ``gae``: token rewards (outcome + optional dense ``token_rewards`` − kl_coef·KL) and the critic's
  ``values`` through GAE(gamma, lam).
For the group estimators, kl_coef > 0 subtracts the KL penalty's (undiscounted) return-to-go
from each token's advantage; they read the outcome ``rewards`` only, so a batch's dense
``token_rewards`` are not part of their advantages (compute_advantages warns). ``returns`` is
the signal before any whitening: what a critic regresses on (GAE: advantages + values),
reinforce++'s returns-to-go, a grouped estimator's advantages.

Groups: rows with equal ``group_id`` when the batch has one, else rows [kG, (k+1)G). A group
split over ranks (fewer than group_size rows here, or, without group_id, rows that were not one
group of the global batch by shard_batch's ``row_index``) is a BatchError, not a wrong number.
Batch statistics (whitening) are taken over the batch given, or with ``mesh=`` over the whole
data-parallel batch (each dp rank passing its own rows), so advantages do not depend on dp.
"""

from __future__ import annotations

import warnings

import attrs
import torch
import torch.distributed as dist

from fsdpfn import keys as K
from fsdpfn.batch import check_groups, validate_batch
from fsdpfn.config import AdvantageConfig
from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.engine.mesh import Mesh, check_mesh
from fsdpfn.agree import agree_on_error, require_loss_tokens, same_on_every_rank
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


GROUPED = ("grpo", "drgrpo", "rloo")


def _dp_sum(mesh: Mesh | None):
    """A float64 sum over the data-parallel ranks of ``mesh`` (None when there is one)."""
    if mesh is None or mesh.dp == 1:
        return None
    group, device = mesh.group("dp"), mesh.device

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        y = x.to(device)
        dist.all_reduce(y, group=group)
        return y.to(x.device)

    return all_reduce


def _several_dp(mesh) -> bool:
    return isinstance(mesh, Mesh) and mesh.dp > 1


def _check(batch, config: AdvantageConfig, mesh) -> torch.Tensor | None:
    """Validate; the group of each row (with group_id) or None. Raises ConfigError/BatchError."""
    if not isinstance(config, AdvantageConfig):
        raise ConfigError(f"config: must be an AdvantageConfig, got {type(config).__name__}")
    check_mesh(mesh, optional=True)
    require, why = _require(batch, config)
    # over dp ranks the loss tokens are counted globally (require_loss_tokens): a rank's part
    # may have none
    validate_batch(batch, require=require, why=why, nonempty=not _several_dp(mesh))
    return check_groups(batch, config.group_size) if config.estimator in GROUPED else None


def _check_in_range(out: dict, mask, config: AdvantageConfig) -> None:
    """The inputs are finite (validate_batch): a non-finite advantage or return on a loss token
    is float32 overflowing (rewards of 1e30 times reward_scale=1e10, or a KL penalty times
    kl_coef), which would train on NaN."""
    for key, x in out.items():
        bad = ~torch.isfinite(x) & mask
        if bad.any():
            b, t = (int(i) for i in bad.nonzero()[0])
            raise BatchError(
                f"{key}: must be finite on loss tokens, got {float(x[b, t])} at row {b}, t={t}: "
                f"the rewards ({K.REWARDS}, {K.TOKEN_REWARDS}) and the KL penalty, after "
                f"reward_scale={config.reward_scale}, reward_bias={config.reward_bias} and "
                f"kl_coef={config.kl_coef}, overflow float32; scale them down")


def _penalty(batch, config: AdvantageConfig, mask):
    if config.kl_coef <= 0:
        return None
    penalty = config.kl_coef * kl(batch[_policy_logp(batch)], batch[K.REF_LOGP], config.kl_kind)
    return torch.where(mask, penalty, torch.zeros((), device=mask.device))


def _grouped(batch, config: AdvantageConfig, rewards, groups, penalty):
    mask = batch[K.LOSS_MASK]
    per_row = group_advantages(rewards, config.group_size, norm_std=config.estimator == "grpo",
                               leave_one_out=config.estimator == "rloo", eps=config.eps,
                               group_ids=groups)
    adv = torch.where(mask, per_row[:, None].expand_as(mask), torch.zeros((), device=mask.device))
    if penalty is not None:
        adv = adv - _returns_to_go(penalty, mask, 1.0)
    return adv, adv.clone()


def _token_level(batch, config: AdvantageConfig, rewards, penalty, all_reduce):
    mask = batch[K.LOSS_MASK]
    dense = batch[K.TOKEN_REWARDS] if K.TOKEN_REWARDS in batch.keys() else None
    zeros = torch.zeros(mask.shape, device=mask.device)
    logp = batch[_policy_logp(batch)] if penalty is not None else zeros
    ref = batch[K.REF_LOGP] if penalty is not None else zeros
    token_rewards = kl_in_reward(dense, rewards, logp, ref, mask, coef=config.kl_coef,
                                 kind=config.kl_kind)
    if config.estimator == "gae":
        return gae(token_rewards, batch[K.VALUES], mask, gamma=config.gamma, lam=config.lam)
    returns = _returns_to_go(token_rewards, mask, config.gamma)  # reinforce++
    return whiten(returns, mask, all_reduce=all_reduce), returns


def compute_advantages(batch, config: AdvantageConfig, *, mesh: Mesh | None = None):
    """New TensorDict with ``advantages`` [B, T] and ``returns`` [B, T] (0 off the loss mask).

    ``mesh``: the batch is this data-parallel rank's part (e.g. from shard_batch); whitening then
    uses the mean and variance of the whole data-parallel batch (an all-reduce over the dp axis),
    and a bad batch on any rank raises on every rank. Without it, statistics are over ``batch``.
    ``advantages`` and ``returns`` are separate tensors.
    """
    error, groups = None, None
    try:
        groups = _check(batch, config, mesh)
    except (BatchError, ConfigError) as exc:
        error = exc
    agree_on_error(mesh if isinstance(mesh, Mesh) else None, error)
    if isinstance(mesh, Mesh):  # a config that differs by rank: one error, not a hang
        same_on_every_rank("compute_advantages", {
            "batch keys": sorted(str(k) for k in batch.keys()),
            **{f"AdvantageConfig.{f.name}": getattr(config, f.name)
               for f in attrs.fields(AdvantageConfig)}}, batch_names=("batch keys",))
    if _several_dp(mesh):
        require_loss_tokens(mesh, batch[K.LOSS_MASK])
    all_reduce = _dp_sum(mesh)
    mask = batch[K.LOSS_MASK]
    rewards = scale_rewards(batch[K.REWARDS], scale=config.reward_scale, bias=config.reward_bias,
                            clip=config.reward_clip)
    penalty = _penalty(batch, config, mask)
    if config.estimator in GROUPED:
        if config.group_size == 1 and K.GROUP_ID not in batch.keys():
            warnings.warn(f"AdvantageConfig.group_size is 1 with estimator "
                          f"{config.estimator!r}: each row is its own group, so every "
                          f"advantage is 0 (set group_size to the samples per prompt)",
                          stacklevel=2)
        if K.TOKEN_REWARDS in batch.keys():
            warnings.warn(f"batch key {K.TOKEN_REWARDS!r}: estimator {config.estimator!r} reads "
                          f"the outcome {K.REWARDS!r} only, so the dense rewards are not part "
                          f"of the advantages (estimator 'reinforce++' or 'gae' adds them)",
                          stacklevel=2)
        adv, returns = _grouped(batch, config, rewards, groups, penalty)
    else:
        adv, returns = _token_level(batch, config, rewards, penalty, all_reduce)
    if config.whiten and config.estimator != "reinforce++":
        adv = whiten(adv, mask, all_reduce=all_reduce)
    error = None
    try:
        _check_in_range({K.ADVANTAGES: adv, K.RETURNS: returns}, mask, config)
    except BatchError as exc:
        error = exc
    agree_on_error(mesh if isinstance(mesh, Mesh) else None, error)
    out = batch.copy()
    out.set(K.ADVANTAGES, adv.float().contiguous())
    out.set(K.RETURNS, returns.float().contiguous())
    return out
