"""Losses: PPO policy (clip, dual clip, decoupled behaviour weights truncated or masked, GSPO
ratio, CISPO), clipped value, SFT, Bradley-Terry, DPO/IPO.

Token-level inputs are [..., T] with a bool mask[..., T]; the last dim is tokens. Values under a
False mask change neither a loss nor its gradient (they are replaced with torch.where before any
arithmetic). All math is float32. Stats are dicts of 0-dim detached float32 tensors, token-means
over the mask whatever the loss aggregation.

Returns: `policy_loss` and `value_loss` give (loss, stats); `sft_loss`, `bradley_terry_loss` and
`dpo_loss` give the loss tensor alone, their `*_with_stats` twins give (loss, stats). The `*_terms`
functions give per-token losses (0 under the mask) and indicators, for callers that normalise over
a global batch with `aggregate_sum`; likewise `sft_loss_sum`, `bradley_terry_loss_sum` and
`dpo_loss_sum` give a loss sum (and statistic sums) that the mean forms divide by the local count
and fsdpfn.algos by the global one: the math of each loss is written once.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.ops.aggregate import (aggregate, aggregate_sum, as_mask, check_mode,
                                  check_same_shape, masked_max, masked_values)
from fsdpfn.ops.correction import BehavWeights, behav_stats, behav_weights

__all__ = [
    "PolicyTerms", "policy_loss_terms", "policy_loss",
    "ValueTerms", "value_loss_terms", "value_loss", "value_loss_with_stats",
    "sft_loss", "sft_loss_with_stats", "sft_loss_sum",
    "bradley_terry_loss", "bradley_terry_loss_with_stats", "bradley_terry_loss_sum",
    "dpo_loss", "dpo_loss_with_stats", "dpo_loss_sum", "DPO_KINDS", "RATIO_LEVELS", "POLICY_KINDS",
]

RATIO_LEVELS = ("token", "sequence")
POLICY_KINDS = ("ppo", "cispo")
DPO_KINDS = ("sigmoid", "ipo")


def _stat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float()


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_values(x, mask).sum() / mask.sum().clamp(min=1).float()


def _check_same_shape(mask: torch.Tensor, *, optional: tuple = (),
                      **tensors: Optional[torch.Tensor]) -> None:
    check_same_shape("mask", mask, optional=optional, **tensors)


# --------------------------------------------------------------------------------------------
# policy
# --------------------------------------------------------------------------------------------

class PolicyTerms(NamedTuple):
    """Per-token pieces of the policy loss, all [..., T] float32 and 0 under a False mask."""
    loss: torch.Tensor          # pg per token (behaviour-weighted), to be aggregated
    clipped: torch.Tensor       # 1.0 where the PPO clip was active
    dual_clipped: torch.Tensor  # 1.0 where the dual clip capped the loss
    ratio: torch.Tensor         # r (detached)
    neg_log_ratio: torch.Tensor  # old_logp - logp (detached), for approx_kl
    behav_weight: Optional[torch.Tensor]  # exp(old_logp - behav_logp) truncated or masked, or None
    behav: Optional[BehavWeights] = None  # the weights with their truncation / mask indicators


def _check_clip_low(clip_low, kind) -> None:
    """PPOConfig's rule, clip_low < 1 (1 - clip_low is the ratio's lower bound); CISPO's weight
    may take 1 (no lower bound), as PPOConfig.cispo_clip_low."""
    if kind == "cispo" and not 0.0 <= clip_low <= 1.0:
        raise ConfigError(f"clip_low must be in [0, 1] with kind='cispo', got {clip_low!r}")
    if kind != "cispo" and not 0.0 <= clip_low < 1.0:
        raise ConfigError(f"clip_low must be in [0, 1), got {clip_low!r}")


def _check_policy_args(clip_low, clip_high, dual_clip, behav_cap, ratio_level, kind, correction):
    _check_clip_low(clip_low, kind)
    if clip_high is not None and not clip_high >= 0.0:
        raise ConfigError(f"clip_high must be >= 0 or None, got {clip_high!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ConfigError(f"dual_clip must be > 1 or None, got {dual_clip!r}")
    if behav_cap is not None and not behav_cap > 0.0:
        raise ConfigError(f"behav_cap must be > 0 or None, got {behav_cap!r}")
    if ratio_level not in RATIO_LEVELS:
        raise ConfigError(f"ratio_level must be one of {list(RATIO_LEVELS)}, got {ratio_level!r}")
    if kind not in POLICY_KINDS:
        raise ConfigError(f"kind must be one of {list(POLICY_KINDS)}, got {kind!r}")
    if kind == "cispo" and dual_clip is not None:
        raise ConfigError(f"dual_clip must be None with kind='cispo' (its loss is already linear "
                          f"in the clipped weight), got {dual_clip!r}")
    if behav_cap is not None and correction is not None:
        raise ConfigError(f"behav_cap must be None with behav_correction={correction!r} (behav_cap "
                          f"is token 'tis' at behav_high=cap), got {behav_cap!r}")


LOG_RATIO_MAX = 88.0  # exp(88) = 1.65e38, the largest round exponent fp32 holds


def _log_ratio(logp, old_logp, mask, ratio_level):
    """log r per token (0 under the mask); 'sequence' is the masked mean over each row (GSPO)."""
    log_r = masked_values(logp, mask) - masked_values(old_logp, mask)
    if ratio_level == "sequence":
        seq = log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1).float()
        log_r = torch.where(mask, seq.expand_as(log_r), torch.zeros_like(log_r))
    return log_r


def _ppo_pg(adv, ratio, clip_low, hi, dual_clip):
    """(pg, clipped, dual) of the clipped surrogate; see `policy_loss_terms`."""
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + hi)
    clipped = pg_clipped > pg_unclipped
    pg = torch.where(clipped, pg_clipped, pg_unclipped)  # where, not max: the whole grad to one side
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual = (adv < 0) & (pg > cap)
        pg = torch.where(dual, cap, pg)
    return pg, clipped, dual


def _cispo_pg(adv, log_r, ratio, clip_low, hi):
    """CISPO: -A sg(clamp(r)) log pi, written as -A sg(clamp(r)) (1 + log r - sg(log r)): the
    same gradient -A clamp(r) grad log pi, and the value -A clamp(r), comparable with PPO's."""
    kept = ratio.detach().clamp(1.0 - clip_low, 1.0 + hi)
    return -adv * kept * (1.0 + log_r - log_r.detach()), kept != ratio.detach()


def _behav(old_logp, behav_logp, mask, correction, level, low, high, cap):
    """BehavWeights, or None without behav_logp; behav_cap is token 'tis' at the cap."""
    if behav_logp is None:
        if correction is not None:
            raise BatchError(f"behav_logp is required by behav_correction={correction!r}, got None")
        return None
    if cap is not None:
        correction, level, low, high = "tis", "token", None, cap
    return behav_weights(old_logp, behav_logp, mask, correction=correction, level=level, low=low,
                         high=high)


def policy_loss_terms(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None,
                      dual_clip=None, behav_logp=None, behav_cap=None, ratio_level="token",
                      kind="ppo", behav_correction=None, behav_level="token", behav_low=None,
                      behav_high=None) -> PolicyTerms:
    """Per-token PPO loss: max(-A r, -A clamp(r, 1 - clip_low, 1 + (clip_high or clip_low))).

    logp, old_logp, advantages, mask (bool), behav_logp: [..., T]. With dual_clip c > 1 the loss of
    tokens with A < 0 is capped at -c A. ratio_level 'sequence' replaces r with exp(masked mean
    over the row of log r), broadcast to the row's tokens. kind 'cispo' (MiniMax-M1) replaces the
    surrogate with -A sg(clamp(r, 1 - clip_low, 1 + hi)) log pi: every token keeps a gradient, scaled
    by its clipped ratio (clip_low=1 leaves no lower bound); `clipped` marks tokens whose r was clamped.
    With behav_logp, each token is multiplied by the detached weight exp(old_logp - behav_logp):
    truncated at behav_cap, or per `behav_weights(correction=behav_correction, level=behav_level,
    low=behav_low, high=behav_high)` (token/sequence/geometric, truncated 'tis' or masked 'mis').
    """
    _check_policy_args(clip_low, clip_high, dual_clip, behav_cap, ratio_level, kind, behav_correction)
    _check_same_shape(mask, logp=logp, old_logp=old_logp, advantages=advantages,
                      behav_logp=behav_logp, optional=("behav_logp",))
    mask = as_mask(mask)
    hi = clip_low if clip_high is None else clip_high
    adv = masked_values(advantages, mask)
    log_r = _log_ratio(logp, old_logp, mask, ratio_level)
    # 1 under the mask. The exponent stops below fp32's overflow (88.72): past it exp is inf,
    # and the branch that where() leaves out, or A = 0, would turn 0 * inf into a NaN loss or
    # gradient. Below it the ratio is the formula's.
    ratio = log_r.clamp(max=LOG_RATIO_MAX).exp()
    if kind == "cispo":
        pg, clipped = _cispo_pg(adv, log_r, ratio, clip_low, hi)
        dual = torch.zeros_like(clipped)
    else:
        pg, clipped, dual = _ppo_pg(adv, ratio, clip_low, hi, dual_clip)
    behav = _behav(old_logp, behav_logp, mask, behav_correction, behav_level, behav_low,
                   behav_high, behav_cap)
    weight = None if behav is None else behav.weight
    if weight is not None:
        pg = pg * weight
    zero = torch.zeros_like(pg)
    return PolicyTerms(
        loss=torch.where(mask, pg, zero),
        clipped=(clipped & mask).float(),
        dual_clipped=(dual & mask).float(),
        ratio=torch.where(mask, ratio, zero).detach(),
        neg_log_ratio=(-log_r).detach(),
        behav_weight=weight,
        behav=behav,
    )


def policy_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=None, dual_clip=None,
                agg="token-mean", behav_logp=None, behav_cap=None, ratio_level="token", kind="ppo",
                behav_correction=None, behav_level="token", behav_low=None, behav_high=None):
    """(loss, stats): `policy_loss_terms` aggregated with `agg` (see `aggregate`).

    stats (token-means over the mask): clip_frac, dual_clip_frac, approx_kl (mean old_logp - logp),
    ratio_mean, ratio_max, and with behav_logp behav_weight_mean, behav_weight_max; with a
    behav_correction also the `behav_stats` diagnostics (behav_gap_mean/max, behav_kl,
    behav_trunc_frac, behav_mask_frac, behav_seq_trunc_frac, behav_seq_mask_frac).
    """
    check_mode(agg, "agg")
    terms = policy_loss_terms(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                              dual_clip=dual_clip, behav_logp=behav_logp, behav_cap=behav_cap,
                              ratio_level=ratio_level, kind=kind, behav_correction=behav_correction,
                              behav_level=behav_level, behav_low=behav_low, behav_high=behav_high)
    mask = as_mask(mask)
    loss = aggregate(terms.loss, mask, agg)
    stats = {
        "clip_frac": _masked_mean(terms.clipped, mask),
        "dual_clip_frac": _masked_mean(terms.dual_clipped, mask),
        "approx_kl": _masked_mean(terms.neg_log_ratio, mask),
        "ratio_mean": _masked_mean(terms.ratio, mask),
        "ratio_max": masked_max(terms.ratio, mask),
    }
    if terms.behav_weight is not None:
        stats["behav_weight_mean"] = _masked_mean(terms.behav_weight, mask)
        stats["behav_weight_max"] = masked_max(terms.behav_weight, mask)
        if behav_correction is not None:
            stats.update(behav_stats(old_logp, behav_logp, mask, terms.behav))
    return loss, {k: _stat(v) for k, v in stats.items()}


# --------------------------------------------------------------------------------------------
# value
# --------------------------------------------------------------------------------------------

class ValueTerms(NamedTuple):
    """Per-token pieces of the value loss, [..., T] float32, 0 under a False mask."""
    loss: torch.Tensor     # 1/2 max((v - R)^2, (clip(v, v_old +- clip) - R)^2)
    clipped: torch.Tensor  # 1.0 where the clipped branch was the larger one


def value_loss_terms(values, old_values, returns, mask, *, clip=0.5) -> ValueTerms:
    """Per-token clipped value loss; clip=None gives the plain 1/2 (v - R)^2."""
    if clip is not None and not clip >= 0.0:
        raise ConfigError(f"clip must be >= 0 or None, got {clip!r}")
    _check_same_shape(mask, values=values, old_values=old_values, returns=returns)
    mask = as_mask(mask)
    v, ret = masked_values(values, mask), masked_values(returns, mask)
    loss = 0.5 * (v - ret).square()
    clipped = torch.zeros_like(mask)
    if clip is not None:
        v_old = masked_values(old_values, mask)
        v_clip = v_old + (v - v_old).clamp(-clip, clip)
        loss_clip = 0.5 * (v_clip - ret).square()
        # clipped where the clamp acts and its term is the larger: within the range v_clip is v
        # itself (the sum v_old + (v - v_old) may differ from v in the last bit, not counted)
        clipped = (loss_clip > loss) & ((v - v_old).abs() > clip) & mask
        loss = torch.where(clipped, loss_clip, loss)
    return ValueTerms(loss=torch.where(mask, loss, torch.zeros_like(loss)), clipped=clipped.float())


def value_loss_with_stats(values, old_values, returns, mask, *, clip=0.5, agg="token-mean"):
    """(loss, stats): `value_loss_terms` aggregated with `agg`; stats vf_clip_frac, value_mean, returns_mean."""
    check_mode(agg, "agg")
    terms = value_loss_terms(values, old_values, returns, mask, clip=clip)
    mask = as_mask(mask)
    loss = aggregate(terms.loss, mask, agg)
    stats = {
        "vf_clip_frac": _masked_mean(terms.clipped, mask),
        "value_mean": _masked_mean(values, mask),
        "returns_mean": _masked_mean(returns, mask),
    }
    return loss, {k: _stat(v) for k, v in stats.items()}


def value_loss(values, old_values, returns, mask, *, clip=0.5, agg="token-mean") -> torch.Tensor:
    """½·max((v−R)², (clip(v, v_old±clip)−R)²) aggregated with `agg`: a 0-dim tensor
    (`value_loss_with_stats` also returns the statistics)."""
    return value_loss_with_stats(values, old_values, returns, mask, clip=clip, agg=agg)[0]


# --------------------------------------------------------------------------------------------
# SFT, reward model, DPO: each written once, as a sum with the count it is divided by (the form
# grad_step's losses take: fsdpfn.algos sums micro-batches and divides by a global count); the
# mean forms divide that sum by the local count.
# --------------------------------------------------------------------------------------------

def sft_loss_sum(logp, mask, *, agg="token-mean"):
    """(nll_sum, count) = aggregate_sum(-logp, mask, agg) for logp[..., T]: the SFT loss is
    nll_sum / max(count, 1)."""
    check_mode(agg, "agg")
    _check_same_shape(mask, logp=logp)
    return aggregate_sum(-logp, mask, agg)


def sft_loss_with_stats(logp, mask):
    """(loss, stats): loss = -token-mean of logp[..., T] over mask (0 if the mask is empty).

    stats: nll (= loss), n_tokens.
    """
    nll_sum, count = sft_loss_sum(logp, mask)
    loss = nll_sum / count.clamp(min=1.0)
    return loss, {"nll": _stat(loss), "n_tokens": _stat(as_mask(mask).sum().float())}


def sft_loss(logp, mask) -> torch.Tensor:
    """-token-mean of logp[..., T] over mask (0 if the mask is empty)."""
    return sft_loss_with_stats(logp, mask)[0]


def _pair_means(loss_sum: torch.Tensor, stat_sums: dict, n_pairs: int):
    """A pair loss's sum form -> its mean form (0, not nan, without pairs)."""
    n = max(n_pairs, 1)
    return loss_sum / n, {k: _stat(v / n) for k, v in stat_sums.items()}


def bradley_terry_loss_sum(chosen, rejected, *, margin=0.0):
    """(loss_sum, stat_sums): sum over pairs of -log sigmoid(chosen - rejected - margin);
    chosen[...], rejected[...] scores. stat_sums (detached): accuracy = sum of
    [chosen > rejected], margin = sum of (chosen - rejected)."""
    check_same_shape("chosen", chosen, rejected=rejected)
    diff = chosen.float() - rejected.float()
    loss_sum = -F.logsigmoid(diff - margin).sum()
    return loss_sum, {"accuracy": (diff > 0).float().sum(), "margin": diff.detach().sum()}


def bradley_terry_loss_with_stats(chosen, rejected):
    """(loss, stats): loss = mean of -log sigmoid(chosen - rejected); chosen[...], rejected[...] scores.

    stats: accuracy = mean(chosen > rejected), margin = mean(chosen - rejected).
    """
    return _pair_means(*bradley_terry_loss_sum(chosen, rejected), chosen.numel())


def bradley_terry_loss(chosen, rejected) -> torch.Tensor:
    """Mean of -log sigmoid(chosen - rejected)."""
    return bradley_terry_loss_with_stats(chosen, rejected)[0]


def _check_dpo_args(beta, kind, pi_chosen, **others) -> None:
    if kind not in DPO_KINDS:
        raise ConfigError(f"kind must be one of {list(DPO_KINDS)}, got {kind!r}")
    if not beta > 0.0:
        raise ConfigError(f"beta must be > 0, got {beta!r}")
    check_same_shape("pi_chosen", pi_chosen, **others)


def dpo_loss_sum(pi_chosen, pi_rejected, ref_chosen, ref_rejected, *, beta=0.1, kind="sigmoid"):
    """(loss_sum, stat_sums) from sequence log-probs [P] (one per pair) of policy and reference.

    logits = (pi_c - pi_r) - (ref_c - ref_r); per pair, sigmoid: -log sigmoid(beta logits), ipo:
    (logits - 1/(2 beta))^2. stat_sums (detached), with rewards r = beta (pi - ref):
    reward_accuracy = sum of [r_c > r_r], chosen_reward = sum of r_c, rejected_reward, margin =
    sum of (r_c - r_r).
    """
    _check_dpo_args(beta, kind, pi_chosen, pi_rejected=pi_rejected, ref_chosen=ref_chosen,
                    ref_rejected=ref_rejected)
    pi_c, pi_r, ref_c, ref_r = (t.float() for t in (pi_chosen, pi_rejected, ref_chosen, ref_rejected))
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    if kind == "sigmoid":
        per_pair = -F.logsigmoid(beta * logits)
    else:
        per_pair = (logits - 1.0 / (2.0 * beta)).square()
    r_c, r_r = beta * (pi_c - ref_c).detach(), beta * (pi_r - ref_r).detach()
    return per_pair.sum(), {"reward_accuracy": (r_c > r_r).float().sum(),
                            "chosen_reward": r_c.sum(), "rejected_reward": r_r.sum(),
                            "margin": (r_c - r_r).sum()}


def dpo_loss_with_stats(pi_chosen, pi_rejected, ref_chosen, ref_rejected, *, beta=0.1, kind="sigmoid"):
    """(loss, stats) from sequence log-probs [P] (one per pair) of the policy and the reference.

    logits = (pi_c - pi_r) - (ref_c - ref_r); sigmoid: mean -log sigmoid(beta logits);
    ipo: mean (logits - 1/(2 beta))^2. stats: reward_accuracy, chosen_reward (mean beta (pi_c -
    ref_c)), rejected_reward, margin (mean chosen - rejected reward).
    """
    sums = dpo_loss_sum(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta=beta, kind=kind)
    return _pair_means(*sums, pi_chosen.numel())


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, *, beta=0.1, kind="sigmoid") -> torch.Tensor:
    """DPO (kind 'sigmoid') or IPO (kind 'ipo') loss; see `dpo_loss_with_stats`."""
    return dpo_loss_with_stats(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta=beta, kind=kind)[0]
