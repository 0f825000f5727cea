"""The minibatches of one grad_step call, cut from the global batch, and their global counts.

Minibatches are cut from the global batch, so that the update does not depend on how rows are
spread over data-parallel ranks: with one minibatch each rank runs its own rows; with more, the
ranks' rows are gathered (in ``row_index`` order when shard_batch made them, else in dp-rank
order), cut into ``optimizer_steps`` consecutive runs of whole units (groups, pairs) of that
order, of ``order`` or of a permutation drawn from ``shuffle_seed``, and each run is balanced over
the ranks by tokens. A minibatch's normaliser counts its loss tokens, sequences and rows over
every data-parallel rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from fsdpfn import keys as K
from fsdpfn.agree import agree_on_error
from fsdpfn.batch import dp_shard_units, global_batch, row_lengths, select_rows
from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.validators import SEED_END

if TYPE_CHECKING:
    from fsdpfn.engine.state import EngineState

__all__ = ["minibatch_rows", "as_order", "minibatches", "global_counts", "denominator"]


def minibatch_rows(n_rows: int, n_minibatches: int, *, group_size: int = 1,
                   order: Sequence[int] | None = None,
                   shuffle_seed: int | None = None) -> list[list[int]]:
    """Split rows into ``n_minibatches`` runs of whole units (``group_size`` consecutive rows),
    in ``order`` of units, or in a permutation of them drawn from ``shuffle_seed``."""
    n_units = n_rows // group_size
    if shuffle_seed is not None:
        order = torch.randperm(n_units, generator=torch.Generator().manual_seed(shuffle_seed))
        order = order.tolist()
    units = list(order) if order is not None else list(range(n_units))
    bounds = [round(i * n_units / n_minibatches) for i in range(n_minibatches + 1)]
    return [[u * group_size + j for u in units[bounds[i]:bounds[i + 1]] for j in range(group_size)]
            for i in range(n_minibatches)]


def as_order(order, shuffle_seed) -> list[int] | None:
    """grad_step's ``order`` as a list of ints (a sequence or an int tensor), its types and
    ``shuffle_seed``'s checked (the permutation is checked once the global batch's size is
    known)."""
    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool)
    if order is not None and shuffle_seed is not None:
        raise ConfigError(f"order: give order or shuffle_seed, not both, got order={order!r} and "
                          f"shuffle_seed={shuffle_seed!r}")
    if shuffle_seed is not None and not (integer(shuffle_seed) and 0 <= shuffle_seed < SEED_END):
        raise ConfigError(f"shuffle_seed: must be an int in [0, 2**63) or None, got "
                          f"{shuffle_seed!r}")
    if order is None:
        return None
    units = order.tolist() if isinstance(order, torch.Tensor) else order
    units = list(units) if not isinstance(units, (str, bytes)) and hasattr(units, "__iter__") \
        else None
    if units is None or not all(integer(u) for u in units):
        raise ConfigError(f"order: must be a sequence of unit indices (ints), got {order!r}")
    return units


def minibatches(state: EngineState, batch, n: int, *, group_size: int, order, shuffle_seed,
                 fn_name: str) -> list:
    """This rank's part of each of the call's ``n`` minibatches (module docstring): cut from the
    global batch, each balanced over the data-parallel ranks by tokens."""
    if n == 1:
        return [batch]
    dp = state.mesh.dp
    whole = global_batch(batch, state.mesh) if dp > 1 else batch
    n_units = whole.batch_size[0] // group_size
    unit = "rows" if group_size == 1 else f"units of {group_size} rows"
    error = None
    if n_units < n:
        error = BatchError(f"batch: {fn_name} takes {n} optimizer steps, one a minibatch, and "
                           f"needs at least {n} {unit} in the global batch (all data-parallel "
                           f"ranks), got {n_units}")
    elif order is not None and sorted(order) != list(range(n_units)):
        error = ConfigError(f"order: must be a permutation of the global batch's {n_units} "
                            f"{unit} (0..{n_units - 1}), got {list(order)!r}")
    agree_on_error(state.mesh if dp > 1 else None, error)
    runs = minibatch_rows(whole.batch_size[0], n, group_size=group_size, order=order,
                          shuffle_seed=shuffle_seed)
    if dp == 1:
        return [select_rows(whole, rows) for rows in runs]
    lens, me = row_lengths(whole), state.mesh.rank("dp")
    parts = []
    for rows in runs:
        units = [rows[i:i + group_size] for i in range(0, len(rows), group_size)]
        mine = dp_shard_units(units, lens, dp, allow_empty=True)[me]
        parts.append(select_rows(whole, mine).to(batch.device or "cpu"))
    return parts


def global_counts(state: EngineState, batch) -> tuple[int, int, int]:
    """Σ loss tokens, sequences, rows over the data-parallel ranks."""
    if batch.batch_size[0]:
        lm = batch.get(K.LOSS_MASK) if K.LOSS_MASK in batch.keys() else batch.get(K.ATTENTION_MASK)
        counts = torch.tensor([int(lm.sum()), int(lm.any(-1).sum()), lm.shape[0]],
                              dtype=torch.int64)
    else:
        counts = torch.zeros(3, dtype=torch.int64)
    if state.mesh.dp > 1:  # over dp only: cp (and tp) ranks hold the same rows, counted once
        dist.all_reduce(counts, group=state.mesh.group("dp"))
    n_tokens, n_seqs, n_rows = (int(c) for c in counts)
    return n_tokens, n_seqs, n_rows


def denominator(normalizer: str, n_tokens: int, n_seqs: int, n_rows: int) -> float:
    value = {"tokens": n_tokens, "sequences": n_seqs, "rows": n_rows, "pairs": n_rows // 2,
             "none": 1}[normalizer]
    return float(max(value, 1))
