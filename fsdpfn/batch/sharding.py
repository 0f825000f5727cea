"""Data-parallel sharding of a global batch and the group checks of grouped estimators.

Units (groups by ``group_id``, or ``group_size`` consecutive rows) stay on one rank; tokens are
balanced over ranks with balanced_partition. shard_batch / gather_batch are public (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDictBase

from fsdpfn import keys as K
from fsdpfn.agree import verdict
from fsdpfn.batch.partition import balanced_partition, unit_sizes
from fsdpfn.batch.validate import check_rows, config_int, row_lengths, select_rows, validate_batch
from fsdpfn.errors import BatchError, ConfigError

__all__ = ["dp_shard_rows", "dp_shard_units", "shard_rows", "gather_rows", "group_units",
           "check_groups", "shard_batch", "gather_batch", "global_batch"]


def dp_shard_rows(seq_lens, dp_size: int, *, group_size: int = 1, algo: str = "lpt"
                  ) -> list[list[int]]:
    """Split the rows of a global batch over dp_size ranks: part r is rank r's rows, ascending.

    Units of `group_size` consecutive rows stay on one rank; tokens are balanced with
    balanced_partition (same bounds). Every part is non-empty.
    Parts are ordered by their first row, so rank order follows row order. Deterministic.
    Raises BatchError when there are fewer units than dp_size.
    """
    config_int("dp_size", dp_size)
    _, starts = unit_sizes(seq_lens, group_size)
    units = [list(range(s, s + group_size)) for s in starts]
    return dp_shard_units(units, seq_lens, dp_size, algo=algo)


def dp_shard_units(units: Sequence[Sequence[int]], seq_lens, dp_size: int, *,
                   algo: str = "lpt", allow_empty: bool = False) -> list[list[int]]:
    """dp_shard_rows for units given as row lists (e.g. the rows of each group_id): every unit
    on one rank, tokens balanced, parts ascending and ordered by their first row (empty parts
    last: with ``allow_empty``, fewer units than ranks leave the last ranks without rows)."""
    config_int("dp_size", dp_size)
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    if len(units) < dp_size and not allow_empty:
        sizes = sorted({len(u) for u in units})
        unit = "rows" if sizes == [1] else "groups"
        raise BatchError(f"batch: needs at least dp_size={dp_size} {unit} so every "
                         f"data-parallel rank gets one, got {len(units)} (B={len(lens)})")
    bins = balanced_partition([sum(lens[r] for r in u) for u in units], dp_size, algo=algo)
    out = [sorted(r for u in b for r in units[u]) for b in bins]
    return sorted(out, key=lambda rows: (not rows, rows[0] if rows else 0))


def shard_rows(batch: TensorDictBase, parts: Sequence[Sequence[int]], index: int) -> TensorDictBase:
    """This part's rows of the global batch: select_rows(batch, parts[index])."""
    return select_rows(batch, parts[index])


def gather_rows(pieces: Sequence[TensorDictBase], parts: Sequence[Sequence[int]]) -> TensorDictBase:
    """Inverse of shard_rows: pieces[i] holds rows parts[i] of the global batch, in that order.

    Returns the global batch with rows back in their original order. The pieces must share
    keys and T.
    """
    if len(pieces) != len(parts):
        raise BatchError(f"gather: need one piece per part, got {len(pieces)} pieces for "
                         f"{len(parts)} parts")
    for i, (piece, rows) in enumerate(zip(pieces, parts)):
        if piece.batch_size[0] != len(rows):
            raise BatchError(f"gather: piece {i} must hold {len(rows)} rows, got "
                             f"{piece.batch_size[0]}")
    order = torch.as_tensor([r for rows in parts for r in rows], dtype=torch.int64)
    if sorted(order.tolist()) != list(range(len(order))):
        raise BatchError(f"gather: parts must cover rows 0..B-1 exactly once, got {parts}")
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    whole = torch.cat(list(pieces), dim=0)
    return whole[inverse.to(whole.device or "cpu")]


# ================================================================ groups and rank-local batches

ROW_INDEX = K.ROW_INDEX  # int64 [B]: a row's index in the global batch, added by shard_batch


def group_units(batch: TensorDictBase, group_size: int = 1) -> list[list[int]]:
    """Rows of each group, groups in order of their first row.

    With ``group_id``: rows with equal ids, wherever they are (group_size > 1 then also checks
    every group has exactly group_size rows). Without: ``group_size`` consecutive rows.
    """
    config_int("group_size", group_size)
    B = batch.batch_size[0]
    if K.GROUP_ID not in batch.keys():
        check_rows(B, group_size, False)
        return [list(range(s, s + group_size)) for s in range(0, B, group_size)]
    ids = batch.get(K.GROUP_ID).cpu()
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    if group_size > 1:
        _check_group_sizes(ids, inverse, counts, group_size, "shard_batch(group_size=...)")
    order = torch.argsort(inverse, stable=True).tolist()
    units, at = [], 0
    for n in counts.tolist():
        units.append(order[at:at + n])
        at += n
    return sorted(units, key=lambda rows: rows[0])


def _check_group_sizes(ids, inverse, counts, group_size: int, source: str) -> None:
    bad = (counts != group_size).nonzero()
    if bad.numel():
        g = int(bad[0])
        rows = (inverse == g).nonzero().flatten().tolist()
        raise BatchError(
            f"{K.GROUP_ID}: every group must have group_size={group_size} rows ({source}), got "
            f"{int(counts[g])} rows with group_id {int(ids[rows[0]])} (rows {rows[:8]}"
            f"{'...' if len(rows) > 8 else ''}); a group split over data-parallel ranks has "
            "fewer: shard with shard_batch, which keeps rows of one group_id on one rank")


def check_groups(batch: TensorDictBase, group_size: int) -> torch.Tensor | None:
    """Verify the groups of a batch for a grouped estimator; the group of each row or None.

    With ``group_id``: returns group[B] int64 (0..n_groups-1 by first row) and raises BatchError
    unless every id has exactly group_size rows (a group split by sharding has fewer). Without:
    rows [kG, (k+1)G) form group k (returns None), B must be divisible by G, and when the batch
    carries ``row_index`` (shard_batch's) group k must be the consecutive global rows
    [jG, (j+1)G) for some j; otherwise shard_batch split the groups.
    """
    config_int("group_size", group_size)
    source = "AdvantageConfig.group_size"
    if K.GROUP_ID in batch.keys():
        ids = batch.get(K.GROUP_ID)
        _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        _check_group_sizes(ids, inverse, counts, group_size, source)
        first = torch.full((len(counts),), ids.shape[0], dtype=torch.int64, device=ids.device)
        first = first.scatter_reduce(0, inverse, torch.arange(ids.shape[0], device=ids.device),
                                     "amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(len(first), device=ids.device)
        return rank[inverse]
    B = batch.batch_size[0]
    if B % group_size:
        raise BatchError(f"batch: B must be divisible by group_size={group_size} ({source}; "
                         f"without {K.GROUP_ID}, rows [k*G, (k+1)*G) form group k), got B={B}")
    if K.ROW_INDEX in batch.keys() and group_size > 1:
        _check_consecutive(batch.get(K.ROW_INDEX).view(-1, group_size), group_size)
    return None


def _check_consecutive(rows: torch.Tensor, G: int) -> None:
    """rows[n_groups, G] global row indices: each must be [jG, (j+1)G) in order."""
    want = rows[:, :1] + torch.arange(G, device=rows.device)
    bad = ((rows[:, 0] % G) != 0) | (rows != want).any(dim=1)
    if bad.any():
        k = int(bad.nonzero()[0])
        raise BatchError(
            f"{K.ROW_INDEX}: group {k} (rows [{k * G}, {(k + 1) * G}) of this batch) must be "
            f"one group of the global batch, rows [j*{G}, (j+1)*{G}), got global rows "
            f"{rows[k].tolist()}: shard_batch split the groups. Shard with "
            f"shard_batch(batch, mesh, group_size={G}), or give the batch a {K.GROUP_ID} key")


def _check_mesh(mesh) -> None:
    """What the batch functions read of a Mesh: its dp size and a rank's coordinate."""
    if isinstance(getattr(mesh, "dp", None), int) and callable(getattr(mesh, "rank", None)):
        return
    raise ConfigError(f"mesh: must be an fsdpfn Mesh (build_mesh), got {type(mesh).__name__}")


def shard_batch(batch: TensorDictBase, mesh, *, group_size: int | None = None) -> TensorDictBase:
    """This data-parallel rank's rows of a global batch held by every rank.

    Groups stay on one rank: rows with equal ``group_id`` when the batch has one, else
    ``group_size`` consecutive rows (GRPO groups). ``group_size=None`` (the default) keeps
    pairs whole: rows 2i and 2i+1 go to one rank whenever B is even and at least 2·dp (so an
    RW/DPO batch needs no argument; any other batch is as exact, its balance a little
    coarser), else rows go one by one; ``group_size=1`` always moves single rows. Tokens are
    balanced over ranks; ranks that share a dp coordinate get the same rows. The result carries
    ``row_index`` (global row of each row) so gather_batch can restore the order and grouped
    estimators and pair losses can refuse groups or pairs that were split.
    """
    _check_mesh(mesh)
    error = None
    try:
        if group_size is not None:
            config_int("group_size", group_size)
        validate_batch(batch)
        has_ids = K.GROUP_ID in batch.keys()
        if group_size is None:
            B = batch.batch_size[0]
            group_size = 2 if not has_ids and B % 2 == 0 and B >= 2 * mesh.dp else 1
        if group_size > 1 and not has_ids:
            check_rows(batch.batch_size[0], group_size, False)
    except (BatchError, ConfigError) as exc:
        error = exc
    _same_global_batch(batch, error, group_size)
    units = group_units(batch, group_size)
    rows = dp_shard_units(units, row_lengths(batch), mesh.dp)[mesh.rank("dp")]
    out = select_rows(batch, rows)
    out.set(ROW_INDEX, torch.as_tensor(rows, dtype=torch.int64, device=batch.device or "cpu"))
    return out


def _same_global_batch(batch, error: Exception | None, group_size: int) -> None:
    """Every rank of the job holds the same global batch: a batch refused on one rank is refused
    on every rank (no rank left waiting in its next collective), and keys, dtypes and shapes
    that differ by rank are a BatchError on every rank (fsdpfn.agree.verdict)."""
    layout = None if error is not None else (group_size, sorted(
        (str(k), str(getattr(v, "dtype", None)), tuple(getattr(v, "shape", ())))
        for k, v in batch.items(include_nested=True, leaves_only=True)))
    every = verdict(error, layout)
    if every is not None:
        shown = "; ".join(f"rank {r}: {lay}" for r, lay in enumerate(every))
        raise BatchError(f"batch: shard_batch takes the global batch, the same on every rank, "
                         f"got different keys, dtypes, shapes or group_size on the ranks: "
                         f"{shown[:600]}")


def gather_batch(batch: TensorDictBase, mesh) -> TensorDictBase:
    """Inverse of shard_batch: every rank gets the global batch, rows in their original order
    (by ``row_index`` when present, else concatenated in dp-rank order)."""
    _check_mesh(mesh)
    error = None
    try:  # what the gather reads; keys and dtypes are compared across ranks after it
        if not isinstance(batch, TensorDictBase) or len(batch.batch_size) != 1:
            raise BatchError(f"batch: must be a tensordict.TensorDict of batch_size [B], got "
                             f"{type(batch).__name__}")
        ids = batch.get(K.INPUT_IDS, None)
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            raise BatchError(f"{K.INPUT_IDS}: gather_batch needs it as a [B, T] tensor, got "
                             f"{type(ids).__name__}")
    except BatchError as exc:
        error = exc
    verdict(error)  # a bad part on one rank: every rank raises, none waits in the gather
    pieces = _dp_pieces(batch, mesh)
    widths = {p.get(K.INPUT_IDS).shape[1] for p in pieces}
    if len(widths) > 1:
        raise BatchError(f"input_ids: ranks must pass the same padded width T to gather_batch, "
                         f"got {sorted(widths)}")
    _same_layout(pieces, "gather_batch")
    return _in_global_order(pieces).exclude(ROW_INDEX)


def global_batch(batch: TensorDictBase, mesh) -> TensorDictBase:
    """The global batch on every rank (CPU), for work that must not depend on how rows are
    spread: rows by ``row_index`` when every rank's batch has it (shard_batch's), else in
    dp-rank order; ranks' widths T may differ (narrower rows are right-padded with zeros, which
    the masks mark as padding). ``row_index`` is kept."""
    pieces = _dp_pieces(batch, mesh)
    _same_layout(pieces, "the step")
    T = max(p.get(K.INPUT_IDS).shape[1] for p in pieces)
    return _in_global_order([_pad_width(p, T) for p in pieces])


def _same_layout(pieces: Sequence[TensorDictBase], fn: str) -> None:
    """Every data-parallel rank's part has the same keys, and each key the same dtype and the
    same shape past its rows (and width T): else one BatchError, the same on every rank (each
    holds every part), naming the first key that differs."""
    def layout(piece):
        return {str(k): (v.dtype, tuple(v.shape[2:] if v.ndim >= 2 else ()))
                for k, v in piece.items(include_nested=True, leaves_only=True)}

    first = layout(pieces[0])
    for rank, piece in enumerate(pieces[1:], start=1):
        other = layout(piece)
        if sorted(other) != sorted(first):
            raise BatchError(f"batch: every data-parallel rank must pass {fn} the same keys, "
                             f"rank {rank} has {sorted(set(other) - set(first))} and lacks "
                             f"{sorted(set(first) - set(other))} of rank 0's {sorted(first)}")
        for key in sorted(first):
            if other[key] != first[key]:
                (d0, s0), (d1, s1) = first[key], other[key]
                raise BatchError(f"{key}: every data-parallel rank must pass {fn} the same dtype "
                                 f"and trailing shape, got {d0} {list(s0)} on rank 0 and {d1} "
                                 f"{list(s1)} on rank {rank}")


def _dp_pieces(batch: TensorDictBase, mesh) -> list[TensorDictBase]:
    """Every data-parallel rank's batch (on the CPU), in dp-rank order."""
    import torch.distributed as dist

    pieces: list = [None] * mesh.dp
    dist.all_gather_object(pieces, batch.cpu(), group=mesh.group("dp"))
    return pieces


def _in_global_order(pieces: Sequence[TensorDictBase]) -> TensorDictBase:
    whole = torch.cat(list(pieces), dim=0)
    if ROW_INDEX in whole.keys():
        whole = whole[torch.argsort(whole.get(ROW_INDEX), stable=True)]
    return whole


def _pad_width(batch: TensorDictBase, T: int) -> TensorDictBase:
    """Right-pad every token-aligned [B, t, ...] entry to width T with zeros (False)."""
    t = batch.get(K.INPUT_IDS).shape[1]
    if t == T:
        return batch
    out = batch.copy()
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == t:
            pad = value.new_zeros((value.shape[0], T - t, *value.shape[2:]))
            out.set(key, torch.cat([value, pad], dim=1))
    return out
