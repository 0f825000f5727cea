"""Pure tensor math: log-probs, entropy, KL, losses, advantages, aggregation, rollout corrections.

Imports nothing of fsdpfn but `fsdpfn.errors`. Every function works on any leading shape where
sensible, takes bool masks, computes in float32 and is autograd-friendly.
"""

from fsdpfn.ops.advantages import (gae, group_advantages, kl_in_reward, outcome_to_token_rewards,
                                   scale_rewards, whiten)
from fsdpfn.ops.aggregate import (AGG_MODES, aggregate, aggregate_sum, aggregate_sum_packed, masked_max,
                                  masked_values)
from fsdpfn.ops.correction import (BEHAV_CORRECTIONS, BEHAV_LEVELS, BehavWeights, behav_gap_terms,
                                   behav_log_ratio, behav_stats, behav_weights)
from fsdpfn.ops.kl import KL_KINDS, kl
from fsdpfn.ops.logprobs import chunked_logprobs, token_entropy, token_logprobs, vocab_parallel_logprobs
from fsdpfn.ops.losses import (DPO_KINDS, POLICY_KINDS, RATIO_LEVELS, PolicyTerms, ValueTerms,
                               bradley_terry_loss, bradley_terry_loss_sum,
                               bradley_terry_loss_with_stats, dpo_loss, dpo_loss_sum,
                               dpo_loss_with_stats, policy_loss, policy_loss_terms, sft_loss,
                               sft_loss_sum, sft_loss_with_stats,
                               value_loss, value_loss_terms, value_loss_with_stats)

__all__ = [
    # logprobs
    "token_logprobs", "token_entropy", "chunked_logprobs", "vocab_parallel_logprobs",
    # kl
    "kl", "KL_KINDS",
    # aggregation
    "aggregate", "aggregate_sum", "aggregate_sum_packed", "masked_values", "masked_max", "AGG_MODES",
    # losses
    "policy_loss", "policy_loss_terms", "PolicyTerms", "value_loss", "value_loss_with_stats",
    "value_loss_terms", "ValueTerms",
    "sft_loss", "sft_loss_with_stats", "sft_loss_sum", "bradley_terry_loss",
    "bradley_terry_loss_with_stats", "bradley_terry_loss_sum", "dpo_loss", "dpo_loss_with_stats",
    "dpo_loss_sum", "DPO_KINDS", "RATIO_LEVELS", "POLICY_KINDS",
    # trainer-rollout mismatch
    "behav_weights", "behav_log_ratio", "behav_gap_terms", "behav_stats", "BehavWeights",
    "BEHAV_CORRECTIONS", "BEHAV_LEVELS",
    # advantages
    "gae", "group_advantages", "whiten", "scale_rewards", "kl_in_reward", "outcome_to_token_rewards",
]
