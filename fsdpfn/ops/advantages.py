"""Advantage estimators and reward shaping: GAE, group-relative (GRPO / RLOO), whitening,
reward scaling, KL-in-reward and outcome-to-token rewards.

Token-level tensors are [..., T] with a bool mask[..., T]; outputs are float32 and 0 under a False
mask. Values under a False mask never reach an output or a gradient (torch.where, not multiply).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.ops.aggregate import as_mask, check_same_shape, check_tensor, masked_values
from fsdpfn.ops.kl import kl

__all__ = ["gae", "group_advantages", "whiten", "scale_rewards", "kl_in_reward",
           "outcome_to_token_rewards"]


def gae(token_rewards, values, mask, *, gamma: float = 1.0, lam: float = 1.0):
    """Generalised advantage estimation over the masked positions of each row.

    token_rewards, values, mask: [..., T] -> (advantages, returns) [..., T] float32. The recursion
    runs backwards over positions where mask is True only: for such a t, delta_t = r_t + gamma
    V_next - V_t and A_t = delta_t + gamma lam A_next, where V_next and A_next belong to the next
    masked position of the row (0 after the last one); masked-out positions are skipped. returns =
    advantages + values on masked positions; both are 0 elsewhere.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"gamma must be in [0, 1], got {gamma!r}")
    if not 0.0 <= lam <= 1.0:
        raise ConfigError(f"lam must be in [0, 1], got {lam!r}")
    check_same_shape("mask", mask, token_rewards=token_rewards, values=values)
    mask = as_mask(mask)
    r, v = masked_values(token_rewards, mask), masked_values(values, mask)
    next_v = r.new_zeros(r.shape[:-1])
    next_a = r.new_zeros(r.shape[:-1])
    adv = [None] * r.shape[-1]
    for t in reversed(range(r.shape[-1])):
        m = mask[..., t]
        a = r[..., t] + gamma * next_v - v[..., t] + gamma * lam * next_a
        adv[t] = torch.where(m, a, torch.zeros_like(a))
        next_v = torch.where(m, v[..., t], next_v)
        next_a = torch.where(m, a, next_a)
    advantages = torch.stack(adv, dim=-1) if adv else r.clone()
    returns = torch.where(mask, advantages + v, torch.zeros_like(advantages))
    return advantages, returns


def group_advantages(rewards, group_size: int, *, norm_std: bool = True, leave_one_out: bool = False,
                     eps: float = 1e-6, group_ids=None):
    """rewards[..., B] -> advantages[..., B] float32; rows [k G, (k+1) G) of the last dimension
    form group k (GRPO / RLOO); leading dimensions are independent batches.

    advantage = r - mean(group), or with leave_one_out r - mean of the other rows of the group
    (RLOO); divided by (std(group) + eps) when norm_std, std the unbiased torch.std of the group's
    rewards. With group_size 1 (no leave_one_out) the advantage is 0: r - mean = 0 and the undefined
    std is taken as 0. With ``group_ids`` [B] (any integers), rows with equal ids form a group
    wherever they are, and every group must have exactly group_size rows (BatchError otherwise).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be an int >= 1, got {group_size!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ConfigError(f"eps must be a finite number >= 0, got {eps!r}")
    if leave_one_out and group_size < 2:
        raise ConfigError(f"group_size must be >= 2 with leave_one_out=True (no other rows to average), "
                          f"got {group_size}")
    check_tensor("rewards", rewards)
    if rewards.dim() < 1 or rewards.shape[-1] % group_size != 0:
        B = rewards.shape[-1] if rewards.dim() else None
        raise BatchError(f"rewards must be [..., B] with B divisible by group_size; got shape "
                         f"{tuple(rewards.shape)} (B = {B}) and group_size = {group_size}")
    if group_ids is None:
        return _consecutive_group_advantages(rewards, group_size, norm_std, leave_one_out, eps)
    order = _group_order(group_ids, rewards.shape[-1], group_size)
    adv = _consecutive_group_advantages(rewards[..., order], group_size, norm_std, leave_one_out,
                                        eps)
    out = torch.empty_like(adv)
    out[..., order] = adv
    return out


def _group_order(group_ids, B: int, group_size: int) -> torch.Tensor:
    """A permutation of the rows [B] that puts the rows of each group next to each other."""
    if tuple(group_ids.shape) != (B,) or group_ids.dtype.is_floating_point:
        raise BatchError(f"group_ids must be integers of shape [B] = [{B}], got "
                         f"{group_ids.dtype} {tuple(group_ids.shape)}")
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts != group_size).any()):
        g = int((counts != group_size).nonzero()[0])
        raise BatchError(f"group_ids: every group must have group_size={group_size} rows, got "
                         f"{int(counts[g])} rows with id {int(group_ids[inverse == g][0])}")
    return torch.argsort(inverse, stable=True)


def _consecutive_group_advantages(rewards, group_size, norm_std, leave_one_out, eps):
    r = rewards.float().reshape(*rewards.shape[:-1], -1, group_size)  # (..., n_groups, G)
    # the group's sum in float64, where a sum of float32 rewards is exact: the mean (of the other
    # rows) of equal rewards is then the reward itself, and they centre to exactly 0. A float32
    # mean of 0.7s can miss by an ulp, and that residue over std 0 + eps is a same-signed
    # advantage of up to 0.06 for the whole group. Other means round to float32 as before.
    total = r.double().sum(-1, keepdim=True)
    if leave_one_out:
        adv = r - ((total - r.double()) / (group_size - 1)).float()
    else:
        adv = r - (total / group_size).float()
    if norm_std:
        single = group_size == 1 or not r.numel()
        std = torch.zeros_like(r[..., :1]) if single else r.std(-1, keepdim=True)
        adv = adv / (std + eps)
    return adv.reshape(rewards.shape)


def whiten(x, mask, *, shift_mean: bool = True, eps: float = 1e-8, all_reduce=None):
    """Whiten x[..., T] over all its masked tokens (REINFORCE++ batch normalisation).

    (x - mean) / sqrt(var + eps), var the unbiased variance over masked tokens (0 with fewer than 2);
    with shift_mean=False the mean is added back. 0 under the mask. Sums are taken in float64.
    ``all_reduce``: a function summing a float64 tensor over the processes that hold the other
    parts of the batch (e.g. the data-parallel ranks); then mean and variance are those of the
    whole batch, and each part is whitened with them.
    """
    total = (lambda t: t) if all_reduce is None else all_reduce
    mask = as_mask(mask)
    xm = masked_values(x, mask).double()
    sums = total(torch.stack([xm.sum(), mask.sum().double()]))
    n = sums[1]
    mean = sums[0] / n.clamp(min=1.0)
    centred = torch.where(mask, xm - mean, torch.zeros_like(xm))
    var = total(centred.square().sum()) / (n - 1.0).clamp(min=1.0)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros_like(out)).float()


def scale_rewards(rewards, *, scale: float = 1.0, bias: float = 0.0, clip: Optional[float] = None):
    """rewards * scale + bias, then clamped to [-clip, clip] when clip is given; float32."""
    if clip is not None and not clip > 0.0:
        raise ConfigError(f"clip must be > 0 or None, got {clip!r}")
    out = rewards.float() * scale + bias
    return out if clip is None else out.clamp(-clip, clip)


def outcome_to_token_rewards(rewards, mask):
    """rewards[...] (one per row), mask[..., T] -> [..., T] float32 with the reward at the row's last
    True position and 0 elsewhere (rows with no True get nothing)."""
    if rewards.shape != mask.shape[:-1]:
        raise BatchError(f"rewards must have shape mask.shape[:-1] = {tuple(mask.shape[:-1])}, "
                         f"got {tuple(rewards.shape)}")
    mask = as_mask(mask)
    pos = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask, pos, -1).amax(-1, keepdim=True) if mask.shape[-1] else None
    if last is None:
        return rewards.float().unsqueeze(-1)[..., :0]
    at_last = (pos == last) & mask
    r = rewards.float().unsqueeze(-1).expand(mask.shape)
    return torch.where(at_last, r, torch.zeros_like(r))


def kl_in_reward(token_rewards, rewards, logp, ref_logp, mask, *, coef: float, kind: str = "k1"):
    """Dense rewards with a KL penalty: [..., T] float32, 0 under the mask.

    token_rewards (or None) [..., T] + each row's scalar reward rewards[...] (or None) placed at its
    last masked token, minus coef * kl(logp, ref_logp, kind) at every masked token.
    """
    mask = as_mask(mask)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if token_rewards is not None:
        out = out + masked_values(token_rewards, mask)
    if rewards is not None:
        out = out + outcome_to_token_rewards(rewards, mask)
    penalty = kl(masked_values(logp, mask), masked_values(ref_logp, mask), kind)
    return torch.where(mask, out - coef * penalty, torch.zeros_like(out))
