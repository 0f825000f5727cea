"""Batch key names: the only place they are spelled."""

INPUT_IDS = "input_ids"            # int64 [B, T]
ATTENTION_MASK = "attention_mask"  # bool [B, T], contiguous prefix per row
LOSS_MASK = "loss_mask"            # bool [B, T], never at t=0, implies attention_mask
LOGP = "logp"                      # float32 [B, T]
OLD_LOGP = "old_logp"
REF_LOGP = "ref_logp"
BEHAV_LOGP = "behav_logp"
ENTROPY = "entropy"
REWARDS = "rewards"                # float32 [B]
GROUP_ID = "group_id"              # int64 [B]: rows with equal ids form one group (GRPO / RLOO)
ROW_INDEX = "row_index"            # int64 [B]: a row's index in the global batch (shard_batch)
TOKEN_REWARDS = "token_rewards"    # float32 [B, T]
VALUES = "values"
OLD_VALUES = "old_values"
RETURNS = "returns"
ADVANTAGES = "advantages"

# token-aligned float keys: float32 [B, T], 0 where t=0 or attention_mask is False
TOKEN_FLOAT_KEYS = (LOGP, OLD_LOGP, REF_LOGP, BEHAV_LOGP, ENTROPY, TOKEN_REWARDS, VALUES,
                    OLD_VALUES, RETURNS, ADVANTAGES)

# keys the engine reads or the layout fixes: never an output key of forward_logp / compute_values
INPUT_KEYS = (INPUT_IDS, ATTENTION_MASK, LOSS_MASK, REWARDS, GROUP_ID, ROW_INDEX)
