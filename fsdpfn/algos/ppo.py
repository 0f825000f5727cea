"""PPO / GRPO actor update: a policy loss plus a three-line step."""

from __future__ import annotations

from fsdpfn import keys as K
from fsdpfn.algos.common import (AGG_NORMALIZER, masked_max, minibatch_order, present,
                                 token_mean_stat)
from fsdpfn.config import PPOConfig
from fsdpfn.errors import ConfigError
from fsdpfn.ops import aggregate_sum, kl, policy_loss_terms
from fsdpfn.step import StepContext, grad_step

__all__ = ["ppo_loss", "ppo_step"]


def ppo_loss(config: PPOConfig):
    """loss_fn for grad_step: clipped policy loss (+ KL to ref_logp, − entropy bonus)."""

    def loss_fn(outputs, mb, ctx: StepContext):
        mask = mb[K.LOSS_MASK]
        logp = outputs[K.LOGP]
        behav = mb[K.BEHAV_LOGP] if config.use_behav_logp and present(mb, K.BEHAV_LOGP) else None
        terms = policy_loss_terms(logp, mb[K.OLD_LOGP], mb[K.ADVANTAGES], mask,
                                  clip_low=config.clip_low, clip_high=config.clip_high,
                                  dual_clip=config.dual_clip, behav_logp=behav,
                                  behav_cap=config.behav_cap, ratio_level=config.ratio_level)
        pg_sum, _ = aggregate_sum(terms.loss, mask, config.agg)
        loss = pg_sum
        stats = {"pg_loss": pg_sum.detach(),
                 "clip_frac": token_mean_stat(terms.clipped, mask, ctx),
                 "dual_clip_frac": token_mean_stat(terms.dual_clipped, mask, ctx),
                 "approx_kl": token_mean_stat(terms.neg_log_ratio, mask, ctx),
                 "ratio_mean": token_mean_stat(terms.ratio, mask, ctx),
                 "ratio_max": masked_max(terms.ratio, mask)}
        if behav is not None:
            stats["behav_weight_mean"] = token_mean_stat(terms.behav_weight, mask, ctx)
            stats["behav_weight_max"] = masked_max(terms.behav_weight, mask)
        if K.ENTROPY in outputs.keys():
            ent_sum, _ = aggregate_sum(outputs[K.ENTROPY], mask, config.agg)
            loss = loss - config.entropy_coef * ent_sum
            stats["entropy"] = token_mean_stat(outputs[K.ENTROPY], mask, ctx)
        if config.kl_coef > 0:
            kl_tok = kl(logp, mb[K.REF_LOGP], config.kl_kind)
            kl_sum, _ = aggregate_sum(kl_tok, mask, config.agg)
            loss = loss + config.kl_coef * kl_sum
            stats["kl"] = token_mean_stat(kl_tok, mask, ctx)
        return loss, stats

    return loss_fn



def ppo_step(state, batch, config: PPOConfig):
    """Actor update: ``config.n_minibatches`` optimizer steps. Needs old_logp and advantages
    (and ref_logp when kl_coef > 0; behav_logp is used when present and use_behav_logp)."""
    if not isinstance(config, PPOConfig):
        raise ConfigError(f"config: must be a PPOConfig, got {type(config).__name__}")
    require = (K.LOSS_MASK, K.OLD_LOGP, K.ADVANTAGES) + ((K.REF_LOGP,) if config.kl_coef else ())
    why = {K.OLD_LOGP: "the PPO ratio; compute it with forward_logp(..., out_key='old_logp')",
           K.ADVANTAGES: "the policy gradient; compute it with compute_advantages",
           K.REF_LOGP: f"the KL term (kl_coef={config.kl_coef})"}
    return grad_step(state, batch, ppo_loss(config), optimizer_steps=config.n_minibatches,
                     normalizer=AGG_NORMALIZER[config.agg], require=require, why=why,
                     with_entropy=config.entropy_coef > 0, temperature=config.temperature,
                     order=minibatch_order(state, batch, shuffle=config.shuffle,
                                           seed=config.seed),
                     fn_name="ppo_step")
