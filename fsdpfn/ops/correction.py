"""Trainer-rollout mismatch: importance weights old/behav (truncated or masked) and diagnostics.

The rollout engine samples from pi_behav (its own kernels, precision and batch shapes); the trainer
recomputes old_logp. The policy gradient of each token is multiplied by a detached weight built
from the log-ratio log w = old_logp - behav_logp over loss tokens:

  level 'token':     log w_t                          (per token)
  level 'sequence':  sum_t log w_t over the row        (the product of the token ratios)
  level 'geometric': mean_t log w_t over the row       (their geometric mean)

The row-level values are broadcast to every loss token of the row. Then, with bounds [low, high]:

  correction None:  w                                     (the plain decoupled-PPO weight)
  correction 'tis': clamp(w, low, high)                   (truncated IS; low=None: no lower bound)
  correction 'mis': w if low <= w <= high else 0          (masked IS: ICE-POP at token level,
                                                           sequence / geometric masks at row level)

A masked token keeps its place in the loss normaliser (its term is 0, as in ICE-POP's objective),
so the gradient scale does not depend on how many tokens were dropped.

Inputs are [..., T] with a bool mask[..., T]; leading dims index rows. Values under a False mask
change nothing (torch.where before any arithmetic). float32 math; the outputs are detached. A
row's product may overflow to inf: it is then above any bound (truncated to `high`, or masked).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.ops.aggregate import as_mask, masked_max, masked_values
from fsdpfn.ops.kl import kl

__all__ = ["BEHAV_CORRECTIONS", "BEHAV_LEVELS", "BehavWeights", "behav_log_ratio", "behav_weights",
           "behav_gap_terms", "behav_stats"]

BEHAV_CORRECTIONS = ("tis", "mis")
BEHAV_LEVELS = ("token", "sequence", "geometric")


class BehavWeights(NamedTuple):
    """Detached per-token weights and indicators [..., T] (0 under the mask), per-row flags [...]."""
    weight: torch.Tensor        # the factor on each token's policy-gradient term
    truncated: torch.Tensor     # 1.0 where 'tis' clamped the weight
    masked: torch.Tensor        # 1.0 where 'mis' dropped the token (weight 0)
    seq_truncated: torch.Tensor  # [...] 1.0 for rows with a loss token that was truncated
    seq_masked: torch.Tensor     # [...] 1.0 for rows with a loss token that was dropped


def check_behav_args(correction, level, low, high) -> None:
    """ConfigError naming the argument, the rule and the value."""
    if correction is not None and correction not in BEHAV_CORRECTIONS:
        raise ConfigError(f"behav_correction must be one of {list(BEHAV_CORRECTIONS)} or None, "
                          f"got {correction!r}")
    if level not in BEHAV_LEVELS:
        raise ConfigError(f"behav_level must be one of {list(BEHAV_LEVELS)}, got {level!r}")
    if correction is None and (low is not None or high is not None):
        raise ConfigError(f"behav_low/behav_high need a behav_correction ('tis' or 'mis'), got "
                          f"low={low!r}, high={high!r} with behav_correction=None")
    if correction is not None and not (high is not None and high > 0 and math.isfinite(high)):
        raise ConfigError(f"behav_high must be a finite number > 0 with behav_correction="
                          f"{correction!r}, got {high!r}")
    if low is not None and not (0 <= low < high):
        raise ConfigError(f"behav_low must satisfy 0 <= behav_low < behav_high ({high!r}), got {low!r}")


def default_low(correction: Optional[str], low: Optional[float], high: Optional[float]):
    """'mis' without a lower bound masks below 1/high (a symmetric band in log space)."""
    if correction == "mis" and low is None:
        return 1.0 / high
    return low


def behav_log_ratio(old_logp, behav_logp, mask, level: str = "token") -> torch.Tensor:
    """log w [..., T] at `level` (see the module docstring), 0 under the mask."""
    if level not in BEHAV_LEVELS:
        raise ConfigError(f"behav_level must be one of {list(BEHAV_LEVELS)}, got {level!r}")
    mask = as_mask(mask)
    log_w = masked_values(old_logp, mask) - masked_values(behav_logp, mask)
    if level == "token":
        return log_w
    row = log_w.sum(-1, keepdim=True)
    if level == "geometric":
        row = row / mask.sum(-1, keepdim=True).clamp(min=1).float()
    return torch.where(mask, row.expand_as(log_w), torch.zeros_like(log_w))


def behav_weights(old_logp, behav_logp, mask, *, correction: Optional[str] = None,
                  level: str = "token", low: Optional[float] = None,
                  high: Optional[float] = None) -> BehavWeights:
    """Importance weights pi_old / pi_behav per token; see the module docstring.

    old_logp, behav_logp, mask: [..., T]. 'mis' with low=None masks below 1/high.
    """
    check_behav_args(correction, level, low, high)
    for name, t in (("old_logp", old_logp), ("behav_logp", behav_logp)):
        if t.shape != mask.shape:
            raise BatchError(f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(t.shape)}")
    mask = as_mask(mask)
    low = default_low(correction, low, high)
    log_w = behav_log_ratio(old_logp.detach(), behav_logp.detach(), mask, level)
    weight = log_w.exp()  # may overflow to inf on a long row: then it is out of band
    out_of_band = torch.zeros_like(mask)
    if correction is not None:
        out_of_band = mask & ((weight < (low or 0.0)) | (weight > high))
    truncated = out_of_band if correction == "tis" else torch.zeros_like(mask)
    masked = out_of_band if correction == "mis" else torch.zeros_like(mask)
    if correction == "tis":
        weight = weight.clamp(min=low, max=high)
    weight = torch.where(mask & ~masked, weight, torch.zeros_like(weight))
    return BehavWeights(weight=weight, truncated=truncated.float(), masked=masked.float(),
                        seq_truncated=truncated.any(-1).float(), seq_masked=masked.any(-1).float())


def behav_gap_terms(old_logp, behav_logp, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(|old_logp - behav_logp|, k3 KL(behav || old)) per token [..., T], 0 under the mask.

    k3 with samples from the rollout policy: exp(old - behav) - (old - behav) - 1 (= kl(behav, old,
    'k3')), a non-negative, unbiased estimate of KL(pi_behav || pi_old).
    """
    mask = as_mask(mask)
    old, behav = masked_values(old_logp, mask).detach(), masked_values(behav_logp, mask).detach()
    zero = torch.zeros_like(old)
    return (torch.where(mask, (old - behav).abs(), zero),
            torch.where(mask, kl(behav, old, "k3").clamp(min=0.0), zero))  # >= 0 despite rounding


def _mean(x, mask):
    return (torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1)).float()


def behav_stats(old_logp, behav_logp, mask, weights: Optional[BehavWeights] = None) -> dict:
    """Token-mean diagnostics over the mask (0-dim float32): behav_gap_mean, behav_gap_max, behav_kl;
    with `weights` also behav_trunc_frac, behav_mask_frac (tokens) and behav_seq_trunc_frac,
    behav_seq_mask_frac (over rows with a loss token)."""
    mask = as_mask(mask)
    gap, k3 = behav_gap_terms(old_logp, behav_logp, mask)
    stats = {"behav_gap_mean": _mean(gap, mask),
             "behav_gap_max": masked_max(gap, mask),
             "behav_kl": _mean(k3, mask)}
    if weights is not None:
        rows = mask.any(-1)
        stats.update(behav_trunc_frac=_mean(weights.truncated, mask),
                     behav_mask_frac=_mean(weights.masked, mask),
                     behav_seq_trunc_frac=_mean(weights.seq_truncated, rows),
                     behav_seq_mask_frac=_mean(weights.seq_masked, rows))
    return {k: v.detach().float() for k, v in stats.items()}
