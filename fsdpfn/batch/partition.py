"""Partitioning: units (rows, groups, pairs) into balanced bins, and micro-batch planning.

balanced_partition is the one balancing routine; plan_microbatches (micro-batches under a token
budget) and the data-parallel sharding (fsdpfn.batch.sharding) both use it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from fsdpfn.batch.validate import config_int
from fsdpfn.errors import BatchError, ConfigError

__all__ = ["balanced_partition", "plan_microbatches"]

ALGOS = ("lpt", "kk", "ffd")
# "ffd" was this option's first name, though what runs for it is LPT (sorted greedy into the
# lightest bin), not first-fit decreasing; it stays accepted as an alias of "lpt".
ALGO_ALIASES = {"ffd": "lpt"}


def _check_algo(algo) -> str:
    """The algorithm that runs for `algo` ("ffd" -> "lpt"); ConfigError for an unknown name."""
    if algo not in ALGOS:
        raise ConfigError(f"algo: must be one of {list(ALGOS)} (\"ffd\" is an alias of \"lpt\"), "
                          f"got {algo!r}")
    return ALGO_ALIASES.get(algo, algo)


def unit_sizes(seq_lens, group_size: int) -> tuple[list[int], list[int]]:
    """(unit sizes, first row of each unit): units are `group_size` consecutive rows."""
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    config_int("group_size", group_size)
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


def balanced_partition(sizes: Sequence[int], k: int, *, algo: str = "lpt") -> list[list[int]]:
    """Split unit indices into exactly k bins with balanced load sums.

    algo="lpt" (the default) runs LPT (sorted greedy: largest unit first, into the lightest
    bin); algo="kk" runs LPT and Karmarkar-Karp (largest differencing) and keeps the one with
    the smaller largest bin; "ffd" is an alias of "lpt" kept for older callers. The result is
    then refined by local moves (which never raise the largest bin).
    Guarantees (OPT = best possible largest bin, mean = sum/k, m = largest unit):
      largest bin <= (4/3 - 1/(3k)) * OPT        (Graham's LPT bound)
      largest bin <= mean + (1 - 1/k) * m        (list-scheduling bound)
    No bin is empty when there are at least k units. Bins are in no
    particular order; units within a bin are unsorted.
    """
    config_int("k", k)
    algo = _check_algo(algo)
    sizes = list(sizes)
    bad = [i for i, s in enumerate(sizes)
           if not isinstance(s, int) or isinstance(s, bool) or s < 0]
    if bad:
        raise ConfigError(f"sizes: must be integers >= 0 (a unit's tokens), got "
                          f"{sizes[bad[0]]!r} at index {bad[0]}")
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
                      group_size: int = 1, algo: str = "lpt", min_n_mbs: int = 1,
                      cp: int = 1, strict: bool = True) -> list[list[int]]:
    """Split rows into micro-batches: lists of row indices, ascending within each list.

    seq_lens[B] are real tokens per row (row_lengths(batch)). Units of `group_size` consecutive
    rows (groups, pairs) never split. The count is k = max(min(n_mbs, U), min_n_mbs, F), where U
    is the number of units and F the number of first-fit-decreasing bins under
    `max_tokens_per_mb` (F = 0 without a budget): n_mbs is a minimum that never asks for more
    micro-batches than units (an empty one would run a pass over nothing). Pass min_n_mbs = the
    largest count over data-parallel ranks so all ranks run the same number of forward/backward
    passes. The units are then spread over exactly k bins by
    balanced_partition(algo=algo); with a budget, if that spreading breaks the budget, the FFD
    bins (plus empty ones) refined by local moves are used instead. (That bin count and fallback
    are first-fit decreasing whatever `algo` is: `algo` picks only the balancing.)

    ``strict=False`` makes the budget soft: a unit longer than it goes alone in its own
    micro-batch instead of raising (what MicroBatchSpec's automatic budget does).

    Guarantees: every row exactly once; every micro-batch <= max_tokens_per_mb tokens (with
    strict=False: or a unit longer than that, alone); exactly
    k micro-batches; an empty micro-batch ([]) only when min_n_mbs exceeds the units.
    Without a budget the largest micro-batch is <= (4/3 - 1/(3k)) * OPT and
    <= mean + (1 - 1/k) * largest unit (see balanced_partition); with a budget the same holds
    unless the fallback was needed. Deterministic; micro-batches
    are ordered by their first row, empty ones last.

    With context parallelism ``cp`` > 1 the budget is per cp rank: a micro-batch's pack is
    padded to a multiple of cp (at most cp - 1 tokens, never visible) and each cp rank holds
    1/cp of it, so a micro-batch may hold up to cp * max_tokens_per_mb real tokens.

    Raises ConfigError for n_mbs/min_n_mbs/group_size/cp < 1, max_tokens_per_mb <= 0 or an
    unknown algo; BatchError when one unit is longer than a strict budget.
    """
    config_int("n_mbs", n_mbs)
    config_int("min_n_mbs", min_n_mbs)
    config_int("cp", cp)
    if max_tokens_per_mb is not None:
        config_int("max_tokens_per_mb", max_tokens_per_mb)
    _check_algo(algo)
    sizes, starts = unit_sizes(seq_lens, group_size)
    k = max(min(n_mbs, len(sizes)), min_n_mbs)
    if max_tokens_per_mb is None:
        return _to_rows(balanced_partition(sizes, k, algo=algo), starts, group_size)
    budget = max_tokens_per_mb * cp  # ceil(N / cp) <= max_tokens_per_mb  <=>  N <= budget
    if strict:
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
