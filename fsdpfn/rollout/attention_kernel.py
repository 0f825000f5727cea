"""Decode attention over the slot cache as a Triton split-KV kernel (``attention="triton"``).

One new token per row attends its own cache length, the G query heads of each kv head together.
torch's flash forward, handed the G heads as G query positions (``attention="flash"``), computes
each sequence on a tile of at least 64 query rows of which G (6 for Qwen2-1.5B) are real, so at
decode it spends most of its time on padding rather than on reading the cache. Here a program
holds the G query heads of one (row, kv head) in a tile of 16 and streams a range of that row's
cache positions through it, so the step reads each live key and value once, with a tile that is
mostly real:

1. ``attention_split_kernel``, one program per (row, kv head, split of the positions): online
   softmax over blocks of BLOCK_N positions below the row's length; it writes the split's output
   and log-sum-exp (or, with one split, the final output in the model's dtype).
2. ``attention_merge_kernel``, one program per (row, query head), only with several splits: the
   splits' outputs weighted by their share of the row's softmax mass.

Splits are chosen per launch so that rows x kv heads x splits fills the GPU; at 512 rows of a
2-kv-head model one split is enough. Positions at or past a row's length are never read.

Shared prompts (``shared=``). The n samples of one prompt hold the same bits in the prompt's
positions of their caches (the decode loop prefills a prompt once and copies its KV to its n
slots), and without sharing each row reads that copy on its own. With the rows' groups given
(prefix_tables), ``attention_prefix_kernel``, one program per (group, kv head), reads the
group's prompt positions once, from its first row's cache, for the query heads of all its rows
in one tile (up to PREFIX_TILE query vectors: 10 rows of a 6-query-head group), in pieces of
PREFIX_LEN positions (one program each), and keeps each row's (output, log-sum-exp) per piece;
the split kernel then starts each such row's split 0 from those (the online softmax carried on)
and reads only the row's own positions. At 512 rows of 8 samples per 256-token prompt and a
mean context of 768, 29% fewer bytes: 90 against 104 µs a layer on the H200.

Against torch's flash forward, which computes each row on a query tile of at least 64 rows of
which only the kv head's query heads are real, this reads the cache near the copy bandwidth
(per-layer times: BENCHMARKS.md, "Decode attention kernel").
"""

from __future__ import annotations

import functools

import torch

__all__ = ["refusal", "decode", "prefix_tables", "group_rows"]

BLOCK_N = 128  # cache positions per inner step (64 and 32 were slower on the H200)
TARGET_PROGRAMS = 1024  # enough programs for the GPU; fewer rows split their cache more
PREFIX_TILE = 64  # query vectors per program of attention_prefix_kernel (rows x G query heads)
PREFIX_BLOCK_N = 64  # its cache positions per inner step
PREFIX_LEN = 256  # positions per program of it (longer prompts: more programs a group); 64
# and 128 were slower on the H200 at 256-position prompts (their pieces' partial outputs cost
# more than the parallelism brings: BENCHMARKS.md, "Decode attention kernel")
PREFIX_WARPS = 4
MIN_SHARED = 128  # a shorter shared prefix is read per row: its own launch would not pay


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_split_kernel(q, k, v, used, out, part_o, part_l, first, pre_o, pre_l, scale,
                               sq_r, sq_h, sk_s, sk_h, sk_l, so_r, so_h, G, KV, SPLITS, SPLIT_LEN,
                               PRE_SPLITS, PRE_LEN, BLOCK_G: tl.constexpr,
                               BLOCK_N: tl.constexpr, D: tl.constexpr,
                               DIRECT: tl.constexpr, SHARED: tl.constexpr,
                               PRECISION: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        n = tl.load(used + r)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        real = g < G
        heads = h * G + g
        qv = tl.load(q + r.to(tl.int64) * sq_r + heads[:, None] * sq_h + d[None, :],
                     mask=real[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        if SHARED:  # positions [0, first[r]) were attended by attention_prefix_kernel, in
            p0 = tl.load(first + r)  # pieces of PRE_LEN: split 0 starts from their (output,
            # log-sum-exp) pairs, folded into the running state of the online softmax
            pieces = tl.where(sp == 0, tl.minimum((p0 + PRE_LEN - 1) // PRE_LEN, PRE_SPLITS), 0)
            at = (r.to(tl.int64) * KV * G + heads) * PRE_SPLITS
            for j in range(0, pieces):
                lj = tl.load(pre_l + at + j, mask=real, other=-float("inf"))
                oj = tl.load(pre_o + (at + j)[:, None] * D + d[None, :], mask=real[:, None],
                             other=0.0)
                m_new = tl.maximum(m_i, lj)
                none = m_new == -float("inf")  # padded heads: nothing yet on either side
                alpha = tl.where(none, 1.0, tl.exp(m_i - m_new))
                beta = tl.where(none, 0.0, tl.exp(lj - m_new))
                l_i = l_i * alpha + beta
                acc = acc * alpha[:, None] + oj * beta[:, None]
                m_i = m_new
        else:
            p0 = 0
        start = p0 + sp * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, n)
        base = r.to(tl.int64) * sk_s + h * sk_h
        for s0 in range(start, end, BLOCK_N):
            cols = s0 + tl.arange(0, BLOCK_N)
            live = cols < end
            kt = tl.load(k + base + cols[None, :] * sk_l + d[:, None], mask=live[None, :],
                         other=0.0)  # [D, BLOCK_N]
            s = tl.dot(qv, kt, input_precision=PRECISION) * scale
            s = tl.where(live[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = tl.load(v + base + cols[:, None] * sk_l + d[None, :], mask=live[:, None],
                         other=0.0)  # [BLOCK_N, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
            m_i = m_new
        some = l_i > 0
        o = acc / tl.where(some, l_i, 1.0)[:, None]
        if DIRECT:
            tl.store(out + r.to(tl.int64) * so_r + heads[:, None] * so_h + d[None, :],
                     o.to(out.dtype.element_ty), mask=real[:, None])
        else:
            at = (r.to(tl.int64) * KV * G + heads) * SPLITS + sp  # [R, heads, SPLITS]
            tl.store(part_o + at[:, None] * D + d[None, :], o, mask=real[:, None])
            tl.store(part_l + at, tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)),
                                           -float("inf")), mask=real)

    @triton.jit
    def attention_prefix_kernel(q, k, v, members, lengths, pre_o, pre_l, scale, sq_r, sq_h, sk_s,
                                sk_h, sk_l, G, KV, MB, PRE_SPLITS, PRE_LEN, BLOCK_Q: tl.constexpr,
                                BLOCK_N: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr):
        # one program per (group, kv head): the G query heads of each of the group's rows (up
        # to MB rows) in one tile of BLOCK_Q, against the first lengths[group] positions of the
        # group's first row's cache (every row of the group holds the same bits there), read
        # once for all of them, in pieces of PRE_LEN positions (program axis 2, so that a few
        # groups still fill the GPU); each row's (output, log-sum-exp) over each piece goes to
        # pre_o / pre_l, where the split kernel's split 0 takes them up
        gi = tl.program_id(0)
        h = tl.program_id(1)
        piece = tl.program_id(2)
        n = tl.load(lengths + gi)
        start = piece * PRE_LEN
        end = tl.minimum(start + PRE_LEN, n)
        t = tl.arange(0, BLOCK_Q)
        m = t // G
        d = tl.arange(0, D)
        row = tl.load(members + gi.to(tl.int64) * MB + m, mask=m < MB, other=-1)
        real = row >= 0
        row = tl.where(real, row, 0).to(tl.int64)
        heads = h * G + t % G
        qv = tl.load(q + row[:, None] * sq_r + heads[:, None] * sq_h + d[None, :],
                     mask=real[:, None], other=0.0)
        leader = tl.load(members + gi.to(tl.int64) * MB)
        base = tl.maximum(leader, 0).to(tl.int64) * sk_s + h * sk_h
        m_i = tl.full([BLOCK_Q], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, D], tl.float32)
        for s0 in range(start, end, BLOCK_N):
            cols = s0 + tl.arange(0, BLOCK_N)
            live = cols < end
            kt = tl.load(k + base + cols[None, :] * sk_l + d[:, None], mask=live[None, :],
                         other=0.0)  # [D, BLOCK_N]
            s = tl.dot(qv, kt, input_precision=PRECISION) * scale
            s = tl.where(live[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = tl.load(v + base + cols[:, None] * sk_l + d[None, :], mask=live[:, None],
                         other=0.0)  # [BLOCK_N, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
            m_i = m_new
        keep = real & ((t * 0 + start) < n)  # an empty piece (or line) writes nothing
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        at = (row * KV * G + heads) * PRE_SPLITS + piece  # [R, heads, PRE_SPLITS]
        tl.store(pre_o + at[:, None] * D + d[None, :], o, mask=keep[:, None])
        tl.store(pre_l + at, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), mask=keep)

    @triton.jit
    def attention_merge_kernel(part_o, part_l, out, so_r, so_h, HEADS, SPLITS,
                               SP: tl.constexpr, D: tl.constexpr):
        r = tl.program_id(0)
        hq = tl.program_id(1)
        s = tl.arange(0, SP)
        d = tl.arange(0, D)
        at = (r.to(tl.int64) * HEADS + hq) * SPLITS + s
        lse = tl.load(part_l + at, mask=s < SPLITS, other=-float("inf"))
        w = tl.exp(lse - tl.max(lse, 0))  # the first split is never empty: max is finite
        o = tl.load(part_o + at[:, None] * D + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
        merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out + r.to(tl.int64) * so_r + hq * so_h + d, merged.to(out.dtype.element_ty))

    return attention_split_kernel, attention_merge_kernel, attention_prefix_kernel


def refusal(device: torch.device, head_dim: int) -> str | None:
    """Why the kernel cannot serve this decode step (None: it can): it needs CUDA with Triton
    and a head size that is a power of two from 16 to 256."""
    import importlib.util

    triton = importlib.util.find_spec("triton") is not None
    if device.type != "cuda" or not triton or head_dim < 16 or head_dim > 256 \
            or head_dim & (head_dim - 1):
        return (f"'triton' needs CUDA with Triton installed and a head size that is a power of "
                f"two from 16 to 256, got {device.type}{'' if triton else ' without Triton'} "
                f"and {head_dim}")
    return None


def splits_for(rows: int, kv: int, length: int, block_n: int = BLOCK_N,
               want: int | None = None) -> tuple[int, int]:
    """(splits, positions per split, a multiple of block_n) for ``rows`` rows of ``kv`` heads
    attending up to ``length`` positions; about ``want`` splits if given, else enough for
    TARGET_PROGRAMS programs."""
    if want is None:
        want = max(1, min(-(-TARGET_PROGRAMS // (rows * kv)), -(-length // block_n)))
    per = -(-length // want)
    per = -(-per // block_n) * block_n
    return -(-length // per), per


def decode(q, k_cache, v_cache, used, length: int, scale: float, block_n: int = BLOCK_N,
           splits: int | None = None, num_warps: int = 4, num_stages: int = 2,
           shared: tuple | None = None, shared_len: int | None = None):
    """q [R, heads, D] of one new token per row (D contiguous); the cache [S, kv, L, D] of which
    row r reads its first used[r] positions (1 <= used[r] <= length <= L; rows are slots
    [0, R)). Returns [R, heads * D] in q's dtype. ``splits`` overrides the choice of splits_for;
    it, block_n, num_warps and num_stages are the benchmark's knobs
    (benchmarks/decode_attention.py).

    ``shared``: (first, members, lengths) of rows whose caches begin with the same bits (the
    samples of one prompt): members [C, MB] int32, each line the rows (< R) of one group, -1
    padded; lengths [C] int32, the positions the group shares (0: an unused line); first [>= R]
    int32, each row's shared length (0 for a row in no group). A group's shared positions are
    read once, from its first row's cache, for all its rows (attention_prefix_kernel); each row
    then reads only its own positions past them. See prefix_tables. ``shared_len``: a bound on
    lengths (default ``length``): the shared positions are read in pieces of PREFIX_LEN, one
    program each, and this many of them are provisioned."""
    R, heads, D = q.shape
    kv = k_cache.shape[1]
    G = heads // kv
    assert v_cache.stride() == k_cache.stride(), "k and v caches share one layout"
    splits, per = splits_for(R, kv, length, block_n, splits)
    out = torch.empty(R, heads, D, dtype=q.dtype, device=q.device)
    direct = splits == 1
    if direct:
        part_o = part_l = out  # unused
    else:
        part_o = torch.empty(R, heads, splits, D, dtype=torch.float32, device=q.device)
        part_l = torch.empty(R, heads, splits, dtype=torch.float32, device=q.device)
    attention_split_kernel, attention_merge_kernel, attention_prefix_kernel = _kernels()
    used = used.to(torch.int32)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding
    first = pre_o = pre_l = used  # unused without shared
    if shared is not None:
        first, members, lengths = shared
        pieces = max(1, -(-int(shared_len or length) // PREFIX_LEN))
        pre_o = torch.empty(R, heads, pieces, D, dtype=torch.float32, device=q.device)
        pre_l = torch.empty(R, heads, pieces, dtype=torch.float32, device=q.device)
        attention_prefix_kernel[(members.shape[0], kv, pieces)](
            q, k_cache, v_cache, members, lengths, pre_o, pre_l, scale, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), G, kv, members.shape[1],
            pieces, PREFIX_LEN, BLOCK_Q=max(16, 1 << (G * members.shape[1] - 1).bit_length()),
            BLOCK_N=PREFIX_BLOCK_N, D=D, PRECISION=precision, num_warps=PREFIX_WARPS,
            num_stages=num_stages)
    attention_split_kernel[(R, kv, splits)](
        q, k_cache, v_cache, used, out, part_o, part_l, first, pre_o, pre_l, scale, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        out.stride(1), G, kv, splits, per, pre_l.shape[-1] if shared is not None else 1,
        PREFIX_LEN, BLOCK_G=max(16, 1 << (G - 1).bit_length()),
        BLOCK_N=block_n, D=D, DIRECT=direct, SHARED=shared is not None, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    if not direct:
        attention_merge_kernel[(R, heads)](part_o, part_l, out, out.stride(0), out.stride(1),
                                           heads, splits,
                                           SP=max(2, 1 << (splits - 1).bit_length()), D=D)
    return out.view(R, heads * D)


def group_rows(group: int) -> int:
    """How many rows one line of a prefix table holds: as many as fit their query heads
    (``group`` per kv head) in a tile of PREFIX_TILE; below 2, sharing cannot pay."""
    return PREFIX_TILE // group


def prefix_tables(groups, rows: int, group: int, device) -> tuple:
    """(first [rows], members [C, MB], lengths [C]) int32 on ``device`` for decode's ``shared``,
    from ``groups``: (shared length, the rows) per set of rows whose caches hold the same bits in
    their first ``shared length`` positions. A set larger than MB = group_rows(group) rows is
    cut into lines of MB rows; a line of one row, or a length under MIN_SHARED, is not shared.
    C = rows // 2 lines, enough for any grouping of ``rows`` rows."""
    mb = group_rows(group)
    first = torch.zeros(rows, dtype=torch.int32)
    members = torch.full((max(1, rows // 2), max(1, mb)), -1, dtype=torch.int32)
    lengths = torch.zeros(max(1, rows // 2), dtype=torch.int32)
    line, seen = 0, set()
    for length, ids in groups:
        if seen & set(ids) or len(set(ids)) < len(ids):
            raise ValueError(f"groups: a row is in one group at most, got {list(ids)} again")
        seen |= set(ids)
        if length < MIN_SHARED or mb < 2:
            continue
        for i in range(0, len(ids), mb):
            chunk = ids[i:i + mb]
            if len(chunk) < 2:
                continue
            if max(chunk) >= rows or min(chunk) < 0:
                raise ValueError(f"groups: rows must be in [0, {rows}), got {chunk}")
            members[line, :len(chunk)] = torch.tensor(chunk, dtype=torch.int32)
            lengths[line] = length
            first[chunk] = length
            line += 1
    return first.to(device), members.to(device), lengths.to(device)
