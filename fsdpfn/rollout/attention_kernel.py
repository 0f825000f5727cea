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

Against torch's flash forward, which computes each row on a query tile of at least 64 rows of
which only the kv head's query heads are real, this reads the cache near the copy bandwidth
(per-layer times: BENCHMARKS.md, "Decode attention kernel").
"""

from __future__ import annotations

import functools

import torch

__all__ = ["refusal", "decode"]

BLOCK_N = 128  # cache positions per inner step (64 and 32 were slower on the H200)
TARGET_PROGRAMS = 1024  # enough programs for the GPU; fewer rows split their cache more


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def attention_split_kernel(q, k, v, used, out, part_o, part_l, scale, sq_r, sq_h, sk_s, sk_h,
                               sk_l, so_r, so_h, G, KV, SPLITS, SPLIT_LEN, BLOCK_G: tl.constexpr,
                               BLOCK_N: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr,
                               PRECISION: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        n = tl.load(used + r)
        start = sp * SPLIT_LEN
        end = tl.minimum(start + SPLIT_LEN, n)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        real = g < G
        heads = h * G + g
        qv = tl.load(q + r.to(tl.int64) * sq_r + heads[:, None] * sq_h + d[None, :],
                     mask=real[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
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
           splits: int | None = None, num_warps: int = 4, num_stages: int = 2):
    """q [R, heads, D] of one new token per row (D contiguous); the cache [S, kv, L, D] of which
    row r reads its first used[r] positions (1 <= used[r] <= length <= L; rows are slots
    [0, R)). Returns [R, heads * D] in q's dtype. ``splits`` overrides the choice of splits_for;
    it, block_n, num_warps and num_stages are the benchmark's knobs
    (benchmarks/decode_attention.py)."""
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
    attention_split_kernel[(R, kv, splits)](
        q, k_cache, v_cache, used, out, part_o, part_l, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        G, kv, splits, per, BLOCK_G=max(16, 1 << (G - 1).bit_length()), BLOCK_N=block_n, D=D,
        DIRECT=direct, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)  # fp32: no TF32 rounding
    if not direct:
        attention_merge_kernel[(R, heads)](part_o, part_l, out, out.stride(0), out.stride(1),
                                           heads, splits,
                                           SP=max(2, 1 << (splits - 1).bit_length()), D=D)
    return out.view(R, heads * D)
