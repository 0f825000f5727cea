"""The public batch: validation, packing, micro-batch planning and data-parallel sharding.

Public layout (API.md "Batch layout"): a TensorDict with batch_size [B], rows right-padded to T.
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
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import attrs
import torch
from tensordict import TensorDict, TensorDictBase

from fsdpfn import keys as K
from fsdpfn.errors import BatchError, ConfigError

__all__ = [
    "validate_batch", "row_lengths", "select_rows",
    "Packed", "pack", "unpack", "unpack_seqs", "apply_scatter", "seq_sum",
    "next_token_targets", "shift_to_token_aligned",
    "plan_microbatches", "balanced_partition", "dp_shard_rows", "dp_shard_units", "shard_rows",
    "gather_rows", "group_units", "check_groups", "shard_batch", "gather_batch",
]

ALGOS = ("ffd", "kk")


# ================================================================ validation


def validate_batch(batch, *, require: Sequence[str] = (), vocab_size: int | None = None,
                   group_size: int | None = None, pairs: bool = False,
                   why: Mapping[str, str] | None = None) -> None:
    """Raise BatchError unless `batch` follows the public layout; never mutates it.

    input_ids and attention_mask are always required; `require` adds keys (e.g. loss_mask,
    ref_logp) and `why[key]` says what needs them, for the message. Checks, in order:
    batch_size [B] with B >= 1; input_ids int64 [B, T]; attention_mask bool [B, T], a contiguous
    prefix with at least one True per row; token ids in [0, vocab_size) on real tokens (>= 0
    when vocab_size is None); loss_mask bool [B, T], False at t=0, implies attention_mask, and
    (only when loss_mask is in `require`) at least one True in the batch; every key of
    keys.TOKEN_FLOAT_KEYS present is float32 [B, T] and finite on real tokens; rewards float32 [B]
    finite; group_id and row_index int64 [B]; B divisible by group_size; B even when `pairs`
    (row 2i chosen, 2i+1 rejected). Group membership is checked by check_groups.
    Padding positions are not inspected. All checks are vectorized.
    """
    B = _check_container(batch)
    _check_required(batch, (K.INPUT_IDS, K.ATTENTION_MASK, *require), why or {})
    ids, attn = batch.get(K.INPUT_IDS), batch.get(K.ATTENTION_MASK)
    _check_tensor(K.INPUT_IDS, ids, torch.int64, None, B)
    T = ids.shape[1]
    _check_tensor(K.ATTENTION_MASK, attn, torch.bool, (B, T), B)
    _check_prefix_mask(attn)
    _check_token_ids(ids, attn, vocab_size)
    if K.LOSS_MASK in batch.keys():
        _check_loss_mask(batch.get(K.LOSS_MASK), attn, (B, T), B,
                         nonempty=K.LOSS_MASK in require)
    for key in K.TOKEN_FLOAT_KEYS:
        if key in batch.keys():
            x = batch.get(key)
            _check_tensor(key, x, torch.float32, (B, T), B)
            _check_finite(key, x, attn)
    if K.REWARDS in batch.keys():
        r = batch.get(K.REWARDS)
        _check_tensor(K.REWARDS, r, torch.float32, (B,), B)
        _check_finite(K.REWARDS, r, None)
    for key in (K.GROUP_ID, K.ROW_INDEX):
        if key in batch.keys():
            _check_tensor(key, batch.get(key), torch.int64, (B,), B)
    _check_rows(B, group_size, pairs)


def _check_container(batch) -> int:
    if not isinstance(batch, TensorDictBase):
        raise BatchError(f"batch: must be a tensordict.TensorDict, got {type(batch).__name__}; "
                         "build one with TensorDict({...}, batch_size=[B])")
    if len(batch.batch_size) != 1:
        raise BatchError(f"batch: batch_size must be [B] (one dim, the rows), got "
                         f"{list(batch.batch_size)}")
    B = batch.batch_size[0]
    if B < 1:
        raise BatchError("batch: must hold at least one row, got "
                         f"batch_size={list(batch.batch_size)}")
    return B


def _check_required(batch, required: Sequence[str], why: Mapping[str, str]) -> None:
    present = set(batch.keys())
    for key in dict.fromkeys(required):  # ordered, without repeats
        if key not in present:
            layout = key in (K.INPUT_IDS, K.ATTENTION_MASK)
            reason = why.get(key, "the public batch layout" if layout else "this call")
            raise BatchError(f"batch is missing key {key!r} (needed for {reason}); keys present: "
                             f"{sorted(present)}")


def _check_tensor(key, x, dtype, shape, B) -> None:
    if not isinstance(x, torch.Tensor):
        raise BatchError(f"{key}: must be a tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        raise BatchError(f"{key}: must have dtype {dtype}, got {x.dtype}")
    if shape is None:  # input_ids fixes T
        if x.ndim != 2 or x.shape[1] < 1:
            raise BatchError(f"{key}: must have shape [B, T] with B={B}, T >= 1, got "
                             f"{list(x.shape)}")
    elif tuple(x.shape) != tuple(shape):
        want = "[B]" if len(shape) == 1 else "[B, T]"
        raise BatchError(f"{key}: must have shape {want} = {list(shape)}, got {list(x.shape)}")


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True of `bad` (row-major), as Python ints."""
    return tuple(int(i) for i in bad.nonzero()[0])


def _check_prefix_mask(attn: torch.Tensor) -> None:
    empty = ~attn.any(dim=1)
    if empty.any():
        b = _first(empty)[0]
        raise BatchError(f"{K.ATTENTION_MASK}: every row needs at least one real token (True), got "
                         f"a row of all False at row {b}; drop empty rows before calling fsdpfn")
    gap = attn[:, 1:] & ~attn[:, :-1]  # True right after a False: not a prefix
    if gap.any():
        b, t = _first(gap)
        raise BatchError(f"{K.ATTENTION_MASK}: must be a contiguous prefix of True per row "
                         f"(right padding), got True at row {b}, t={t + 1} after False at t={t}")


def _check_token_ids(ids, attn, vocab_size) -> None:
    bad = attn & (ids < 0)
    rule = "must be >= 0 on real tokens"
    if vocab_size is not None:
        bad = bad | (attn & (ids >= vocab_size))
        rule = f"must be in [0, vocab_size={vocab_size}) on real tokens"
    if bad.any():
        b, t = _first(bad)
        raise BatchError(f"{K.INPUT_IDS}: {rule}, got {int(ids[b, t])} at row {b}, t={t}")


def _check_loss_mask(lm, attn, shape, B, *, nonempty: bool) -> None:
    _check_tensor(K.LOSS_MASK, lm, torch.bool, shape, B)
    if lm[:, 0].any():
        b = _first(lm[:, 0])[0]
        raise BatchError(f"{K.LOSS_MASK}: must be False at t=0 (the first token has no "
                         f"log-prob), got True at row {b}, t=0")
    outside = lm & ~attn
    if outside.any():
        b, t = _first(outside)
        raise BatchError(f"{K.LOSS_MASK}: must imply {K.ATTENTION_MASK}, got True at row {b}, "
                         f"t={t} where {K.ATTENTION_MASK} is False")
    if nonempty and not lm.any():
        raise BatchError(f"{K.LOSS_MASK}: must have at least one True, got none (all {B} rows "
                         "are all False; nothing would be trained on)")


def _check_finite(key, x, attn) -> None:
    bad = ~torch.isfinite(x)
    if attn is not None:
        bad = bad & attn
    if bad.any():
        idx = _first(bad)
        where = f"row {idx[0]}" + (f", t={idx[1]}" if len(idx) > 1 else "")
        what = "on real tokens" if attn is not None else "in every row"
        raise BatchError(f"{key}: must be finite {what}, got {float(x[idx])} at {where}")


def _check_rows(B: int, group_size: int | None, pairs: bool) -> None:
    if group_size is not None:
        _config_int("group_size", group_size)
        if B % group_size:
            raise BatchError(f"batch: B must be divisible by group_size={group_size} (rows "
                             f"[k*G, (k+1)*G) form group k), got B={B}")
    if pairs and B % 2:
        raise BatchError(f"batch: B must be even for pairs (row 2i chosen, 2i+1 rejected), "
                         f"got B={B}")


def _config_int(name: str, value, lo: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{name}: must be an int >= {lo}, got {value!r}")


# ================================================================ rows


def row_lengths(batch) -> list[int]:
    """Real tokens per row, sum of attention_mask[B, T] over T, as Python ints [B]."""
    return batch.get(K.ATTENTION_MASK).sum(dim=1).tolist()


def _rows_tensor(rows, B: int, device) -> torch.Tensor:
    r = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows,
                        dtype=torch.int64).to(device).reshape(-1)
    if r.numel() and (int(r.min()) < 0 or int(r.max()) >= B):
        raise BatchError(f"rows: must be in [0, B={B}), got {r.tolist()}")
    return r


def select_rows(batch: TensorDictBase, rows) -> TensorDictBase:
    """New TensorDict of batch[rows] (rows: ints or int64 tensor), in the order given."""
    return batch[_rows_tensor(rows, batch.batch_size[0], batch.device or "cpu")]


# ================================================================ packing


@attrs.frozen(eq=False)
class Packed:
    """Rows `rows` of a [B, T] batch, packed without padding.

    N = total real tokens, S = number of sequences (= len(rows)). Sequence s is
    input_ids[cu_seqlens[s]:cu_seqlens[s+1]] and came from batch row rows[s].
    """

    input_ids: torch.Tensor      # int64 [N]
    position_ids: torch.Tensor   # int64 [N], 0..len-1 per sequence
    cu_seqlens: torch.Tensor     # int32 [S+1], cu_seqlens[0] = 0
    seq_lens: tuple[int, ...]    # [S]
    rows: torch.Tensor           # int64 [S], row of the original batch
    seq_ids: torch.Tensor        # int64 [N], sequence s of each token
    token_index: torch.Tensor    # int64 [N], rows[seq]*T + position: flat index into [B*T]
    max_seqlen: int
    T: int                       # padded width of the original batch
    B: int                       # rows of the original batch (not S)
    values: dict = attrs.field(factory=dict)  # key -> [N, ...] (token keys) or [S, ...] (row keys)

    def to(self, device) -> "Packed":
        """The same pack with every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name).to(device) for f in attrs.fields(Packed)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        moved["values"] = {k: v.to(device) for k, v in self.values.items()}
        return attrs.evolve(self, **moved)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_seqs(self) -> int:
        return len(self.seq_lens)


def pack(batch: TensorDictBase, keys: Sequence[str] = (), *, rows=None) -> Packed:
    """Pack rows `rows` (default: all, in order) of `batch` into one token stream.

    Each key in `keys` lands in `values`: a tensor whose first two dims are [B, T] is token
    aligned and packed to [N, ...]; any other tensor with first dim B is per row, giving [S, ...].
    rows=[] gives an empty Packed (N = S = 0), the empty micro-batch of plan_microbatches.
    """
    B = batch.batch_size[0]
    ids_full, attn_full = batch.get(K.INPUT_IDS), batch.get(K.ATTENTION_MASK)
    T = ids_full.shape[1]
    r = _rows_tensor(range(B) if rows is None else rows, B, ids_full.device)
    attn = attn_full[r]                                   # (S, T)
    if attn.shape[0]:
        _check_prefix_mask(attn)  # positions below assume right padding
    lens = attn.sum(dim=1)                                # (S,)
    seq_ids, position_ids = attn.nonzero(as_tuple=True)   # row-major = sequence order
    cu = torch.zeros(len(r) + 1, dtype=torch.int32, device=ids_full.device)
    cu[1:] = torch.cumsum(lens, 0)
    seq_lens = tuple(lens.tolist())
    values = {key: _pack_value(batch, key, r, attn, B, T) for key in keys}
    return Packed(input_ids=ids_full[r][attn], position_ids=position_ids, cu_seqlens=cu,
                  seq_lens=seq_lens, rows=r, seq_ids=seq_ids,
                  token_index=r[seq_ids] * T + position_ids,
                  max_seqlen=max(seq_lens, default=0), T=T, B=B, values=values)


def _pack_value(batch, key, r, attn, B, T) -> torch.Tensor:
    if key not in batch.keys():
        raise BatchError(f"batch is missing key {key!r} (needed for packing); keys present: "
                         f"{sorted(batch.keys())}")
    x = batch.get(key)
    if x.ndim >= 2 and tuple(x.shape[:2]) == (B, T):
        return x[r][attn]
    return x[r]


def unpack(packed: Packed, x: torch.Tensor, *, fill: float = 0.0, compact: bool = False):
    """x[N, ...] -> [B, T, ...] with `fill` on padding and on rows not in the pack.

    compact=True gives [S, T, ...] instead, row s being sequence s (rows[s] of the batch).
    Autograd flows through x.
    """
    rows = packed.n_seqs if compact else packed.B
    index = packed.seq_ids * packed.T + packed.position_ids if compact else packed.token_index
    out = x.new_full((rows * packed.T, *x.shape[1:]), fill)
    return out.index_put((index,), x).view(rows, packed.T, *x.shape[1:])


def apply_scatter(out: torch.Tensor, packed: Packed, x: torch.Tensor) -> None:
    """Write a micro-batch's packed x[N, ...] into the full out[B, T, ...] in place.

    Only the packed rows' real tokens are written; everything else in `out` is kept.
    """
    assert tuple(out.shape[:2]) == (packed.B, packed.T), (out.shape, packed.B, packed.T)
    out.view(packed.B * packed.T, *out.shape[2:])[packed.token_index] = x.to(out.dtype)


def unpack_seqs(packed: Packed, y: torch.Tensor, *, fill: float = 0.0) -> torch.Tensor:
    """Per-sequence y[S, ...] -> per-row [B, ...], `fill` on rows not in the pack."""
    out = y.new_full((packed.B, *y.shape[1:]), fill)
    return out.index_put((packed.rows,), y)


def seq_sum(packed: Packed, x: torch.Tensor) -> torch.Tensor:
    """Sum of x[N, ...] over each sequence -> [S, ...] (e.g. sequence log-probs for DPO)."""
    out = x.new_zeros((packed.n_seqs, *x.shape[1:]))
    return out.index_add(0, packed.seq_ids, x)


def next_token_targets(packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets[N], valid[N]): targets[i] = input_ids[i+1] of the same sequence.

    valid is False at each sequence's last token, where targets holds 0 (a safe id to gather at;
    mask it out). A prediction made at i is for token i+1: see shift_to_token_aligned.
    """
    ids = packed.input_ids
    last = _first_or_last(packed, last=True)
    targets = torch.roll(ids, -1).masked_fill(last, 0)
    return targets, ~last


def shift_to_token_aligned(packed: Packed, x_pred: torch.Tensor) -> torch.Tensor:
    """Move x_pred[N, ...] (made at i, about token i+1) to position i+1; 0 at first tokens.

    The result is token aligned like the public logp: out[i] = x_pred[i-1] within a sequence,
    0 where position_ids == 0. Autograd flows through x_pred.
    """
    if x_pred.shape[0] == 0:
        return x_pred.clone()
    shifted = torch.cat([x_pred[:1].new_zeros(x_pred[:1].shape), x_pred[:-1]])
    first = _first_or_last(packed, last=False).view(-1, *([1] * (x_pred.ndim - 1)))
    return torch.where(first, shifted.new_zeros(()), shifted)


def _first_or_last(packed: Packed, *, last: bool) -> torch.Tensor:
    """bool [N]: True at each sequence's first (or last) token."""
    flag = torch.zeros(packed.n_tokens, dtype=torch.bool, device=packed.input_ids.device)
    if packed.n_tokens:
        starts = packed.cu_seqlens[1:] - 1 if last else packed.cu_seqlens[:-1]
        flag[starts.long()] = True
    return flag


# ================================================================ partitioning


def _units(seq_lens, group_size: int) -> tuple[list[int], list[int]]:
    """(unit sizes, first row of each unit): units are `group_size` consecutive rows."""
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    _config_int("group_size", group_size)
    if any(x < 0 for x in lens):
        raise BatchError(f"seq_lens: must be >= 0, got {lens}")
    if len(lens) % group_size:
        raise BatchError(f"batch: B must be divisible by group_size={group_size} (groups and "
                         f"pairs stay together), got B={len(lens)}")
    starts = list(range(0, len(lens), group_size))
    return [sum(lens[s:s + group_size]) for s in starts], starts


def _lpt(sizes: list[int], k: int) -> list[list[int]]:
    """Sorted-greedy (LPT): largest unit first, each into the currently lightest bin."""
    order = sorted(range(len(sizes)), key=lambda u: (-sizes[u], u))
    heap = [(0, 0, b) for b in range(k)]  # (load, n_units, bin): empty bins first on ties
    bins: list[list[int]] = [[] for _ in range(k)]
    for u in order:
        load, n, b = heapq.heappop(heap)
        bins[b].append(u)
        heapq.heappush(heap, (load + sizes[u], n + 1, b))
    return bins


def _kk(sizes: list[int], k: int) -> list[list[int]]:
    """Karmarkar-Karp largest differencing for k bins."""
    heap = []
    for u in range(len(sizes)):  # each unit a k-way partial partition: (loads, bins) sorted desc
        loads = [sizes[u]] + [0] * (k - 1)
        bins = [[u]] + [[] for _ in range(k - 1)]
        heapq.heappush(heap, (-sizes[u], u, loads, bins))
    tie = len(sizes)
    while len(heap) > 1:
        _, _, la, ba = heapq.heappop(heap)
        _, _, lb, bb = heapq.heappop(heap)
        merged = sorted(((la[i] + lb[k - 1 - i], ba[i] + bb[k - 1 - i]) for i in range(k)),
                        key=lambda p: -p[0])
        loads, bins = [p[0] for p in merged], [p[1] for p in merged]
        heapq.heappush(heap, (-(loads[0] - loads[-1]), tie, loads, bins))
        tie += 1
    return heap[0][3] if heap else [[] for _ in range(k)]


def _refine(bins: list[list[int]], sizes: list[int]) -> list[list[int]]:
    """Local search: move a unit u from a bin of load H to the lightest bin L while L + u < H.

    Each move lowers the sum of squared loads, so it terminates; it never raises the largest
    load nor puts a bin over a budget the heavier bin met. Then, while a bin is empty and
    another holds two or more units, move that bin's smallest unit into the empty one.
    """
    bins = [list(b) for b in bins]
    loads = [sum(sizes[u] for u in b) for b in bins]
    moved = True
    while moved:
        moved = False
        light = min(range(len(bins)), key=lambda b: (loads[b], b))
        for b in sorted(range(len(bins)), key=lambda b: (-loads[b], b)):
            u = next((u for u in sorted(bins[b], key=lambda u: (sizes[u], u))
                      if 0 < sizes[u] and loads[light] + sizes[u] < loads[b]), None)
            if u is not None:
                bins[b].remove(u), bins[light].append(u)
                loads[b] -= sizes[u]
                loads[light] += sizes[u]
                moved = True
                break
    for e in range(len(bins)):
        donors = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        if not bins[e] and donors:
            b = max(donors, key=lambda b: (len(bins[b]), -b))
            u = min(bins[b], key=lambda u: (sizes[u], u))
            bins[b].remove(u), bins[e].append(u)
    return bins


def balanced_partition(sizes: Sequence[int], k: int, *, algo: str = "ffd") -> list[list[int]]:
    """Split unit indices into exactly k bins with balanced load sums.

    Computes LPT (sorted greedy) and, for algo="kk", Karmarkar-Karp too; keeps the one with
    the smaller largest bin, then refines it by local moves (which never raise the largest bin).
    Guarantees (OPT = best possible largest bin, mean = sum/k, m = largest unit):
      largest bin <= (4/3 - 1/(3k)) * OPT        (Graham's LPT bound)
      largest bin <= mean + (1 - 1/k) * m        (list-scheduling bound)
    No bin is empty when there are at least k units. Bins are in no
    particular order; units within a bin are unsorted.
    """
    _config_int("k", k)
    if algo not in ALGOS:
        raise ConfigError(f"algo: must be one of {ALGOS}, got {algo!r}")
    sizes = list(sizes)
    cands = [_lpt(sizes, k)] + ([_kk(sizes, k)] if algo == "kk" else [])
    best = min(cands, key=lambda bins: max(sum(sizes[u] for u in b) for b in bins))
    return _refine(best, sizes)


def _ffd(sizes: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing into bins of capacity `budget` (every unit must fit on its own)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for u in sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)):
        b = next((b for b in range(len(bins)) if loads[b] + sizes[u] <= budget), None)
        if b is None:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(u)
        loads[b] += sizes[u]
    return bins


def _to_rows(bins: list[list[int]], starts: list[int], group_size: int) -> list[list[int]]:
    """Unit bins -> row bins, rows ascending; bins ordered by first row, empty bins last."""
    out = [sorted(r for u in b for r in range(starts[u], starts[u] + group_size)) for b in bins]
    return sorted(out, key=lambda rows: (not rows, rows[0] if rows else 0))


def plan_microbatches(seq_lens, *, max_tokens_per_mb: int | None = None, n_mbs: int = 1,
                      group_size: int = 1, algo: str = "ffd", min_n_mbs: int = 1,
                      cp: int = 1) -> list[list[int]]:
    """Split rows into micro-batches: lists of row indices, ascending within each list.

    seq_lens[B] are real tokens per row (row_lengths(batch)). Units of `group_size` consecutive
    rows (groups, pairs) never split. The count is k = max(n_mbs, min_n_mbs, F), where F is the
    number of first-fit-decreasing bins under `max_tokens_per_mb` (F = 0 without a budget);
    pass min_n_mbs = the largest count over data-parallel ranks so all ranks run the same number
    of forward/backward passes. The units are then spread over exactly k bins by
    balanced_partition; with a budget, if that spreading breaks the budget, the FFD bins
    (plus empty ones) refined by local moves are used instead.

    Guarantees: every row exactly once; every micro-batch <= max_tokens_per_mb tokens; exactly
    k micro-batches; an empty micro-batch ([]) only when there are fewer than k units.
    Without a budget the largest micro-batch is <= (4/3 - 1/(3k)) * OPT and
    <= mean + (1 - 1/k) * largest unit (see balanced_partition); with a budget the same holds
    unless the fallback was needed. Deterministic; micro-batches
    are ordered by their first row, empty ones last.

    With context parallelism ``cp`` > 1 the budget is per cp rank: a micro-batch's pack is
    padded to a multiple of cp (at most cp - 1 tokens, never visible) and each cp rank holds
    1/cp of it, so a micro-batch may hold up to cp * max_tokens_per_mb real tokens.

    Raises ConfigError for n_mbs/min_n_mbs/group_size/cp < 1, max_tokens_per_mb <= 0 or an
    unknown algo; BatchError when one unit is longer than the budget.
    """
    _config_int("n_mbs", n_mbs)
    _config_int("min_n_mbs", min_n_mbs)
    _config_int("cp", cp)
    if max_tokens_per_mb is not None:
        _config_int("max_tokens_per_mb", max_tokens_per_mb)
    if algo not in ALGOS:
        raise ConfigError(f"algo: must be one of {ALGOS}, got {algo!r}")
    sizes, starts = _units(seq_lens, group_size)
    k = max(n_mbs, min_n_mbs)
    if max_tokens_per_mb is None:
        return _to_rows(balanced_partition(sizes, k, algo=algo), starts, group_size)
    budget = max_tokens_per_mb * cp  # ceil(N / cp) <= max_tokens_per_mb  <=>  N <= budget
    _check_units_fit(sizes, starts, group_size, max_tokens_per_mb, cp)
    ffd = _ffd(sizes, budget)
    k = max(k, len(ffd))
    bins = balanced_partition(sizes, k, algo=algo)
    if max(sum(sizes[u] for u in b) for b in bins) > budget:
        bins = _refine(ffd + [[] for _ in range(k - len(ffd))], sizes)
    return _to_rows(bins, starts, group_size)


def _check_units_fit(sizes, starts, group_size, per_rank: int, cp: int = 1) -> None:
    budget = per_rank * cp
    for u, size in enumerate(sizes):
        if size > budget:
            what = (f"row {starts[u]}" if group_size == 1 else
                    f"the group of rows {starts[u]}..{starts[u] + group_size - 1}")
            limit = (f"max_tokens_per_mb={per_rank}" if cp == 1 else
                     f"max_tokens_per_mb x cp = {per_rank} x {cp} = {budget} (the budget is "
                     "per context-parallel rank)")
            raise BatchError(f"max_tokens_per_mb: {what} has {size} tokens, more than "
                             f"{limit}; raise max_tokens_per_mb (or shorten that sequence)")


# ================================================================ data-parallel sharding


def dp_shard_rows(seq_lens, dp_size: int, *, group_size: int = 1, algo: str = "ffd"
                  ) -> list[list[int]]:
    """Split the rows of a global batch over dp_size ranks: part r is rank r's rows, ascending.

    Units of `group_size` consecutive rows stay on one rank; tokens are balanced with
    balanced_partition (same bounds). Every part is non-empty.
    Parts are ordered by their first row, so rank order follows row order. Deterministic.
    Raises BatchError when there are fewer units than dp_size.
    """
    _config_int("dp_size", dp_size)
    _, starts = _units(seq_lens, group_size)
    units = [list(range(s, s + group_size)) for s in starts]
    return dp_shard_units(units, seq_lens, dp_size, algo=algo)


def dp_shard_units(units: Sequence[Sequence[int]], seq_lens, dp_size: int, *,
                   algo: str = "ffd") -> list[list[int]]:
    """dp_shard_rows for units given as row lists (e.g. the rows of each group_id): every unit
    on one rank, tokens balanced, parts ascending and ordered by their first row."""
    _config_int("dp_size", dp_size)
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    if len(units) < dp_size:
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
    _config_int("group_size", group_size)
    B = batch.batch_size[0]
    if K.GROUP_ID not in batch.keys():
        _check_rows(B, group_size, False)
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
    _config_int("group_size", group_size)
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


def shard_batch(batch: TensorDictBase, mesh, *, group_size: int = 1) -> TensorDictBase:
    """This data-parallel rank's rows of a global batch held by every rank.

    Groups stay on one rank: rows with equal ``group_id`` when the batch has one, else
    ``group_size`` consecutive rows (GRPO groups; DPO/RW pairs: 2). Tokens are balanced over
    ranks; ranks that share a dp coordinate get the same rows. The result carries ``row_index``
    (global row of each row) so gather_batch can restore the order and grouped estimators can
    refuse groups that were split (sharded with group_size=1 and no group_id).
    """
    has_ids = K.GROUP_ID in batch.keys()
    validate_batch(batch, group_size=group_size if group_size > 1 and not has_ids else None)
    units = group_units(batch, group_size)
    rows = dp_shard_units(units, row_lengths(batch), mesh.dp)[mesh.rank("dp")]
    out = select_rows(batch, rows)
    out.set(ROW_INDEX, torch.as_tensor(rows, dtype=torch.int64, device=batch.device or "cpu"))
    return out


def gather_batch(batch: TensorDictBase, mesh) -> TensorDictBase:
    """Inverse of shard_batch: every rank gets the global batch, rows in their original order
    (by ``row_index`` when present, else concatenated in dp-rank order)."""
    import torch.distributed as dist

    pieces: list = [None] * mesh.dp
    dist.all_gather_object(pieces, batch.cpu(), group=mesh.group("dp"))
    widths = {p.get(K.INPUT_IDS).shape[1] for p in pieces}
    if len(widths) > 1:
        raise BatchError(f"input_ids: ranks must pass the same padded width T to gather_batch, "
                         f"got {sorted(widths)}")
    whole = torch.cat(pieces, dim=0)
    if ROW_INDEX in whole.keys():
        order = torch.argsort(whole.get(ROW_INDEX))
        whole = whole[order]
        whole = whole.exclude(ROW_INDEX)
    return whole
