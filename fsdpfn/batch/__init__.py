"""The public batch: validation, packing, micro-batch planning and data-parallel sharding.

Public layout (docs/api.md "Batch layout"): a TensorDict with batch_size [B], rows right-padded
to T.
Internally rows are *packed*: the real tokens of every row concatenated into one stream of N tokens,
with `cu_seqlens` marking where each sequence starts (the varlen / flash-attention convention).

Stages, in the order the engine uses them:

    validate_batch(batch, require=...)                 # once, at the public entry point
    parts = dp_shard_rows(row_lengths(batch), dp)      # shard_batch: rows of this dp rank
    plan  = plan_microbatches(row_lengths(batch), max_tokens_per_mb=..., n_mbs=...)
    for rows in plan:
        packed = pack(batch, keys, rows=rows)          # input_ids[N], position_ids[N], cu_seqlens
        pred   = model(packed)                         # prediction at i is for token i+1
        logp   = shift_to_token_aligned(packed, pred)  # token aligned, 0 at each first token
        apply_scatter(out, packed, logp)               # into the full [B, T] result

Modules: validate (the public layout's checks, row selection), packing (Packed and the
token-stream helpers), partition (balanced_partition, plan_microbatches), sharding (data-parallel
rows, groups, shard_batch / gather_batch), rows (token lists and a rollout server's answers as
the public layout: pad_rows, rollout_batch). Every name is importable from ``fsdpfn.batch``.
"""

from __future__ import annotations

from fsdpfn.batch import partition, sharding
from fsdpfn.batch.packing import (Packed, apply_scatter, next_token_targets, pack, seq_sum,
                                  shift_to_token_aligned, unpack, unpack_seqs)
from fsdpfn.batch.partition import balanced_partition, plan_microbatches
from fsdpfn.batch.rows import pad_rows, rollout_batch
from fsdpfn.batch.sharding import (check_groups, dp_shard_rows, dp_shard_units, gather_batch,
                                   gather_rows, global_batch, group_units, shard_batch, shard_rows)
from fsdpfn.batch.validate import row_lengths, select_rows, validate_batch

ALGOS = partition.ALGOS          # module constants, still at their old address
ROW_INDEX = sharding.ROW_INDEX

__all__ = [
    "validate_batch", "row_lengths", "select_rows",
    "Packed", "pack", "unpack", "unpack_seqs", "apply_scatter", "seq_sum",
    "next_token_targets", "shift_to_token_aligned",
    "plan_microbatches", "balanced_partition", "dp_shard_rows", "dp_shard_units", "shard_rows",
    "gather_rows", "group_units", "check_groups", "shard_batch", "gather_batch", "global_batch",
    "pad_rows", "rollout_batch",
]
