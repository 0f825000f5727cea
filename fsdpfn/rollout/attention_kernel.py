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
slots), and without sharing each row reads its own copy: n reads of the prompt from HBM. With
the rows' groups given (share_tables: each row's shared length and its group's first row, the
leader), each row reads its shared positions from its leader's cache instead: the same addresses
for the whole group, whose programs run side by side (rows are launched in order and a group's
slots are neighbours), so the group finds them in L2 and the prompt leaves HBM about once. No
kernel or partial output more: at 512 rows of 8 samples per 256-token prompt, 83.8 µs a layer
against 98.2 without sharing and 86.2 with a separate kernel reading each group's prompt once
(the earlier design, removed).

Against torch's flash forward, which computes each row on a query tile of at least 64 rows of
which only the kv head's query heads are real, this reads the cache near the copy bandwidth
(per-layer times: BENCHMARKS.md, "Decode attention kernel").
"""

from __future__ import annotations

import functools

import torch

__all__ = ["refusal", "decode", "share_tables"]

BLOCK_N = 128  # cache positions per inner step (64 and 32 were slower on the H200)
TARGET_PROGRAMS = 1024  # enough programs for the GPU; fewer rows split their cache more


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_split_kernel(q, k, v, used, out, part_o, part_l, first, leader, scale,
                               sq_r, sq_h, sk_s, sk_h, sk_l, so_r, so_h, G, KV, SPLITS, SPLIT_LEN,
                               BLOCK_G: tl.constexpr,
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
        if SHARED:  # positions [0, first[r]) are read from the group's first row's cache:
            # the same addresses for every row of the group, whose programs run side by side
            # and find them in L2, so the prompt's KV leaves HBM about once for the group
            lead = tl.load(leader + r)
            f = tl.load(first + r)
        else:
            lead = r
            f = 0
        start = sp * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, n)
        base = r.to(tl.int64) * sk_s + h * sk_h
        base_lead = lead.to(tl.int64) * sk_s + h * sk_h
        for s0 in range(start, end, BLOCK_N):
            cols = s0 + tl.arange(0, BLOCK_N)
            live = cols < end
            if SHARED:
                at_k = tl.where(cols < f, base_lead, base) + cols * sk_l  # [BLOCK_N]
            else:
                at_k = base + cols * sk_l
            kt = tl.load(k + at_k[None, :] + d[:, None], mask=live[None, :],
                         other=0.0).to(qv.dtype)  # [D, BLOCK_N]; a float8 cache widened
            s = tl.dot(qv, kt, input_precision=PRECISION) * scale
            s = tl.where(live[None, :], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = tl.load(v + at_k[:, None] + d[None, :], mask=live[:, None],
                         other=0.0).to(qv.dtype)  # [BLOCK_N, D]
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

    return attention_split_kernel, attention_merge_kernel


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
           shared: tuple | None = None):
    """q [R, heads, D] of one new token per row (D contiguous); the cache [S, kv, L, D] of which
    row r reads its first used[r] positions (1 <= used[r] <= length <= L; rows are slots
    [0, R)). Returns [R, heads * D] in q's dtype. ``splits`` overrides the choice of splits_for;
    it, block_n, num_warps and num_stages are the benchmark's knobs
    (benchmarks/decode_attention.py).

    ``shared``: (first, leader) int32 [>= R] (share_tables) for rows whose caches begin with the
    same bits (the samples of one prompt): row r reads its first first[r] positions from row
    leader[r]'s cache (the same bits, at addresses the whole group shares, found in L2 by the
    group's programs) and the rest from its own."""
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
    attention_split_kernel, attention_merge_kernel = _kernels()
    used = used.to(torch.int32)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding
    first, leader = shared if shared is not None else (used, used)  # unused without shared
    attention_split_kernel[(R, kv, splits)](
        q, k_cache, v_cache, used, out, part_o, part_l, first, leader, scale, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        out.stride(1), G, kv, splits, per, BLOCK_G=max(16, 1 << (G - 1).bit_length()),
        BLOCK_N=block_n, D=D, DIRECT=direct, SHARED=shared is not None, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages)
    if not direct:
        attention_merge_kernel[(R, heads)](part_o, part_l, out, out.stride(0), out.stride(1),
                                           heads, splits,
                                           SP=max(2, 1 << (splits - 1).bit_length()), D=D)
    return out.view(R, heads * D)


def share_tables(groups, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first [rows], leader [rows]) int32 on ``device`` for decode's ``shared``, from
    ``groups``: (shared length, the rows) per set of rows whose caches hold the same bits in
    their first ``shared length`` positions. Each row of a set of two or more reads those
    positions from the set's first row (its leader); any other row reads its own cache
    (first 0, leader itself). A row in two sets, or out of [0, rows), is refused by name."""
    first = torch.zeros(rows, dtype=torch.int32)
    leader = torch.arange(rows, dtype=torch.int32)
    seen: set = set()
    for length, ids in groups:
        ids = list(ids)
        if seen & set(ids) or len(set(ids)) < len(ids):
            raise ValueError(f"groups: a row is in one group at most, got {ids} again")
        if ids and (max(ids) >= rows or min(ids) < 0):
            raise ValueError(f"groups: rows must be in [0, {rows}), got {ids}")
        seen |= set(ids)
        if len(ids) >= 2 and length > 0:
            first[ids] = int(length)
            leader[ids] = ids[0]
    return first.to(device), leader.to(device)
