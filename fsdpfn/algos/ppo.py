"""PPO / GRPO actor update: a policy loss plus a three-line step."""

from __future__ import annotations

import warnings

import torch

from fsdpfn import keys as K
from fsdpfn.algos.common import (AGG_NORMALIZER, check_config, minibatch_seed, present,
                                 token_mean_stat)
from fsdpfn.config import PPOConfig
from fsdpfn.ops import (aggregate_sum, behav_gap_terms, kl, masked_max, masked_values,
                        policy_loss_terms)
from fsdpfn.engine.objective import Objective
from fsdpfn.engine.step import StepContext, grad_step

__all__ = ["ppo_loss_fn", "ppo_loss", "ppo_step", "ppo_objective"]


def _seq_mean_stat(flags: torch.Tensor, rows: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """A per-row statistic's contribution that becomes its mean over the minibatch's rows with a
    loss token (all ranks) once the engine divides by the normaliser and sums."""
    total = torch.where(rows, flags.float(), torch.zeros((), device=flags.device)).sum()
    return total * (ctx.denominator / max(ctx.n_sequences, 1))


def _behav_weight_stats(behav, mask, ctx) -> dict:
    """How the behaviour weights changed the gradient: means, max, truncated / masked fractions."""
    rows = mask.any(-1)
    return {"behav_weight_mean": token_mean_stat(behav.weight, mask, ctx),
            "behav_weight_max": masked_max(behav.weight, mask),
            "behav_trunc_frac": token_mean_stat(behav.truncated, mask, ctx),
            "behav_mask_frac": token_mean_stat(behav.masked, mask, ctx),
            "behav_seq_trunc_frac": _seq_mean_stat(behav.seq_truncated, rows, ctx),
            "behav_seq_mask_frac": _seq_mean_stat(behav.seq_masked, rows, ctx)}


def _behav_gap_stats(old_logp, mb, mask, ctx) -> dict:
    """Trainer vs rollout over loss tokens: mean and max |old_logp − behav_logp|, k3 KL."""
    gap, k3 = behav_gap_terms(old_logp, mb[K.BEHAV_LOGP], mask)
    return {"behav_gap_mean": token_mean_stat(gap, mask, ctx),
            "behav_gap_max": masked_max(gap, mask),
            "behav_kl": token_mean_stat(k3, mask, ctx)}


def _on_policy_gap(logp, old_logp, mask, ctx) -> torch.Tensor:
    """Mean |logp − old_logp| of the first minibatch (before any update), 0 on the others; scaled
    by n_minibatches because grad_step averages a stat over the minibatches."""
    if ctx.minibatch != 0:
        return torch.zeros((), device=logp.device)
    gap = (masked_values(logp.detach(), mask) - masked_values(old_logp, mask)).abs()
    return token_mean_stat(gap, mask, ctx) * ctx.n_minibatches


def _old_logp(config: PPOConfig, logp, mb) -> torch.Tensor:
    """The ratio's denominator: the batch's old_logp, or (old_logp_from 'forward', or 'auto'
    without it) the training forward itself, detached, so the ratio is exactly 1."""
    if config.old_logp_from == "behav":
        return mb[K.BEHAV_LOGP]
    if config.old_logp_from == "forward" or not present(mb, K.OLD_LOGP):
        return logp.detach()
    return mb[K.OLD_LOGP]


def _policy_terms(config: PPOConfig, logp, old_logp, mb, mask, behav):
    clip_low, clip_high = ((config.clip_low, config.clip_high) if config.policy_loss == "ppo"
                           else config.cispo_bounds)
    low, high = config.behav_bounds
    return policy_loss_terms(logp, old_logp, mb[K.ADVANTAGES], mask,
                             clip_low=clip_low, clip_high=clip_high,
                             dual_clip=config.dual_clip, behav_logp=behav,
                             behav_cap=config.behav_cap, ratio_level=config.ratio_level,
                             kind=config.policy_loss, behav_correction=config.behav_correction,
                             behav_level=config.behav_level, behav_low=low, behav_high=high)


def ppo_loss_fn(config: PPOConfig):
    """loss_fn for grad_step: clipped (or CISPO) policy loss, weighted by the behaviour
    correction (+ KL to ref_logp, − entropy bonus)."""

    def loss_fn(outputs, mb, ctx: StepContext):
        mask = mb[K.LOSS_MASK]
        logp = outputs[K.LOGP]
        has_behav = present(mb, K.BEHAV_LOGP)
        behav = mb[K.BEHAV_LOGP] if config.use_behav_logp and has_behav else None
        old_logp = _old_logp(config, logp, mb)
        terms = _policy_terms(config, logp, old_logp, mb, mask, behav)
        pg_sum, _ = aggregate_sum(terms.loss, mask, config.agg)
        loss = pg_sum
        stats = {"pg_loss": pg_sum.detach(),
                 "clip_frac": token_mean_stat(terms.clipped, mask, ctx),
                 "dual_clip_frac": token_mean_stat(terms.dual_clipped, mask, ctx),
                 "approx_kl": token_mean_stat(terms.neg_log_ratio, mask, ctx),
                 "ratio_mean": token_mean_stat(terms.ratio, mask, ctx),
                 "ratio_max": masked_max(terms.ratio, mask)}
        if has_behav:
            stats.update(_behav_gap_stats(old_logp, mb, mask, ctx))
        if terms.behav is not None:
            stats.update(_behav_weight_stats(terms.behav, mask, ctx))
        if config.check_on_policy:
            stats["on_policy_gap"] = _on_policy_gap(logp, old_logp, mask, ctx)
        if K.ENTROPY in outputs.keys():
            ent_sum, _ = aggregate_sum(outputs[K.ENTROPY], mask, config.agg)
            loss = loss - config.entropy_coef * ent_sum
            stats["entropy"] = token_mean_stat(outputs[K.ENTROPY], mask, ctx)
        if config.kl_coef > 0:
            # untrained tokens (prompt, padding) may hold any finite fill in ref_logp: zeroed
            # first, so no value there reaches the loss or its gradient
            kl_tok = kl(masked_values(logp, mask), masked_values(mb[K.REF_LOGP], mask),
                        config.kl_kind)
            kl_sum, _ = aggregate_sum(kl_tok, mask, config.agg)
            loss = loss + config.kl_coef * kl_sum
            stats["kl"] = token_mean_stat(kl_tok, mask, ctx)
        return loss, stats

    return loss_fn


ppo_loss = ppo_loss_fn  # the factory's former name, kept for callers


def _requirements(config: PPOConfig) -> tuple[tuple[str, ...], dict]:
    needs_old = config.old_logp_from == "batch" or (config.old_logp_from == "auto"
                                                    and config.n_minibatches > 1)
    require = ((K.LOSS_MASK,) + ((K.OLD_LOGP,) if needs_old else ()) + (K.ADVANTAGES,)
               + ((K.REF_LOGP,) if config.kl_coef else ())
               + ((K.BEHAV_LOGP,) if config.old_logp_from == "behav" else ()))
    why = {K.OLD_LOGP: (f"the PPO ratio (n_minibatches={config.n_minibatches}, old_logp_from="
                        f"{config.old_logp_from!r}); compute it with forward_logp(..., "
                        f"out_key='old_logp')"),
           K.ADVANTAGES: "the policy gradient; compute it with compute_advantages",
           K.REF_LOGP: f"the KL term (kl_coef={config.kl_coef})",
           K.BEHAV_LOGP: "old_logp_from='behav': the rollout engine's log-probs of the sampled "
                         "tokens stand in for old_logp"}
    correction = (f"behav_correction={config.behav_correction!r}" if config.behav_correction
                  else f"behav_cap={config.behav_cap}" if config.behav_cap is not None else None)
    if correction and config.use_behav_logp and K.BEHAV_LOGP not in require:
        require += (K.BEHAV_LOGP,)
        why[K.BEHAV_LOGP] = (f"the rollout correction ({correction}): the rollout engine's "
                             f"log-probs of the sampled tokens")
    return require, why


def warn_if_off_policy(stats, config: PPOConfig) -> None:
    """The first minibatch of an on-policy step must have ratio 1: warn, naming likely causes."""
    gap = float(stats["on_policy_gap"])
    if gap <= config.on_policy_tol:
        return
    behav = (f"; trainer vs rollout: behav_gap_mean={float(stats['behav_gap_mean']):.3g}"
             if "behav_gap_mean" in stats.keys() else "")
    warnings.warn(
        f"ppo_step: check_on_policy: the first minibatch's mean |logp - old_logp| is {gap:.3g}, "
        f"above on_policy_tol={config.on_policy_tol} (the ratio must be 1 before the first "
        f"update){behav}. Likely causes: old_logp computed with other weights (a stale state, or "
        f"taken from a rollout engine the weights were not pushed to); a temperature other than "
        f"PPOConfig.temperature={config.temperature}; a dtype or kernel mismatch between the "
        f"forward that made old_logp and the training forward (bf16 vs fp32, dropout, "
        f"nondeterministic attention).", RuntimeWarning, stacklevel=3)


def ppo_objective(config: PPOConfig) -> Objective:
    """The PPO actor's loss and what it reads (old_logp, advantages, ref_logp with a KL term,
    behav_logp with a correction)."""
    check_config(config, PPOConfig)
    require, why = _requirements(config)
    return Objective(ppo_loss_fn(config), normalizer=AGG_NORMALIZER[config.agg], require=require,
                     why=why, with_entropy=config.entropy_coef > 0,
                     temperature=config.temperature, name="ppo_step", critic=False, config=config)


def ppo_step(state, batch, config: PPOConfig, *, mb_spec=None):
    """Actor update: ``config.n_minibatches`` optimizer steps. Needs advantages, and old_logp
    unless one minibatch lets the training forward stand in for it (``old_logp_from``);
    ref_logp when kl_coef > 0; behav_logp is used when present and use_behav_logp, and required
    by behav_cap or behav_correction). ``mb_spec`` overrides the state's micro-batch spec for
    this call."""
    objective = ppo_objective(config)
    state, stats = grad_step(state, batch, objective, optimizer_steps=config.n_minibatches,
                             shuffle_seed=minibatch_seed(state, shuffle=config.shuffle,
                                                         seed=config.seed), mb_spec=mb_spec)
    if config.check_on_policy:
        warn_if_off_policy(stats, config)
    return state, stats
