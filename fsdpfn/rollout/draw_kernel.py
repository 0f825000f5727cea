"""The decode loop's untruncated draw: two small Triton kernels over the logits.

``device_sampling.sample`` makes about nine passes over the [R, V] logits in float32 (the cast,
the scaling, the noise, its log, the race, two argmaxes, the logsumexp), each reading or writing
R x V float32 values. Racing the logits against per-logit noise in one fused pass cuts that
traffic but not the compute: a Philox draw and two logarithms per logit.

This draw needs one uniform per row and one exponential per logit. It inverts the CDF of
softmax(logits / T), the method of FlashInfer's sampling kernels:

1. ``chunk_kernel``, one program per (row, chunk of BLOCK columns), reads the model's logits in
   their own dtype and writes the chunk's max m_c and sum of exp(logit / T - m_c), and its
   first argmax column.
2. ``pick_kernel``, one program per row, rescales the chunks' sums to the row's max M
   (w_c = s_c exp(m_c - M)), draws u ~ U[0, 1) (Philox, ``tl.rand``), takes the first chunk
   whose running sum of w exceeds u * sum(w), then, in that chunk, the first column whose running
   sum of exp(logit / T - M) exceeds the remainder. It reports that column and its exact
   log-prob, logit / T - M - log(sum(w)): the same log_softmax(logits / T) as ``sample``.

The running sums are over at most BLOCK terms in float32 (about 4,096), so a token's chance is
exact up to float32 rounding of its share of one chunk's mass; its log-prob is exact either way.
It reads each logit once, where the race it replaced drew noise and took two logarithms per logit
(its cost: BENCHMARKS.md, "Decode step per kernel").
Greedy rows (T <= 0) take the first column of the row's max (torch's argmax on ties) and report
log_softmax(logits), as ``sample`` does.

An unseeded row's uniform is keyed by a device step counter that the caller advances after each
draw, so a captured CUDA graph draws anew on every replay. A seeded row's uniform is keyed by its
own seed and the index of the token drawn (Philox at (seed, step)): the same seed gives the same
uniform whatever else is batched, in any slot, as ``sample``'s hashed noise does for the first
token. Rows with top-p / top-k keep ``sample`` (their graphs are captured separately).

Why seeded rows have their own path here: the RL recipes seed every request (reproducible
runs), and ``sample``'s hashed noise costs a dozen int64 passes over [R, V] a step, where this
draw costs one uniform per row (the main job's generation with each: BENCHMARKS.md, "The main
job (GRPO from YAML)").
"""

from __future__ import annotations

import functools

import torch

__all__ = ["available", "draw"]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_kernel(logits, stride, temperature, part_m, part_s, part_col, V, CHUNKS,
                     BLOCK: tl.constexpr):
        """One program per (row, chunk): the scaled logits' max, sum of exp(x - max), argmax."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        t = tl.load(temperature + row)
        t = tl.where(t <= 0, 1.0, t)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(logits + row.to(tl.int64) * stride + cols, mask=inside,
                    other=-float("inf")).to(tl.float32)
        scaled = x / t
        m = tl.max(scaled, 0)
        # a chunk of -inf logits (a masked vocabulary) has no mass: exp(-inf - 0) = 0, not NaN
        s = tl.sum(tl.where(inside, tl.exp(scaled - tl.where(m == -float("inf"), 0.0, m)), 0.0),
                   0)
        out = row * CHUNKS + chunk
        tl.store(part_m + out, m)
        tl.store(part_s + out, s)
        tl.store(part_col + out, chunk * BLOCK + tl.argmax(scaled, 0))  # ties: the first

    @triton.jit
    def pick_kernel(logits, stride, temperature, counter, seeds, steps, part_m, part_s, part_col,
                    token, logp, V, CHUNKS, CP: tl.constexpr, BLOCK: tl.constexpr,
                    SEEDED: tl.constexpr):
        """One program per row: the chunk, then the column, where u * total mass is reached."""
        row = tl.program_id(0)
        t = tl.load(temperature + row)
        greedy = t <= 0
        t = tl.where(greedy, 1.0, t)
        c = tl.arange(0, CP)
        live = c < CHUNKS
        m = tl.load(part_m + row * CHUNKS + c, mask=live, other=-float("inf"))
        s = tl.load(part_s + row * CHUNKS + c, mask=live, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(live & (s > 0), s * tl.exp(m - top), 0.0)
        run = tl.cumsum(w, 0)
        total = tl.max(run, 0)  # the running sum's last value (w >= 0)
        lse = top + tl.log(total)
        u = tl.rand(tl.load(counter), row)  # in [0, 1)
        if SEEDED:  # a seeded row: Philox at (its seed, the index of the token drawn)
            seed = tl.load(seeds + row)
            step = tl.load(steps + row).to(tl.int32)
            u = tl.where(seed >= 0, tl.rand(tl.maximum(seed, 0), step), u)
        target = u * total
        # the first chunk whose running sum exceeds the target (rounding: the last with mass)
        k = tl.minimum(tl.sum((run <= target).to(tl.int32), 0),
                       tl.max(tl.where(w > 0, c, -1), 0))
        rest = target - tl.sum(tl.where(c == k - 1, run, 0.0), 0)
        j = tl.arange(0, BLOCK)
        cols = k * BLOCK + j
        inside = cols < V
        x = tl.load(logits + row.to(tl.int64) * stride + cols, mask=inside,
                    other=-float("inf")).to(tl.float32)
        scaled = x / t
        e = tl.where(inside, tl.exp(scaled - top), 0.0)
        # the first column whose running sum exceeds the rest has e > 0; past the chunk's
        # mass (rounding), the last column with e > 0
        at = tl.minimum(tl.sum((tl.cumsum(e, 0) <= rest).to(tl.int32), 0),
                        tl.max(tl.where(e > 0, j, -1), 0))
        drawn = k * BLOCK + at
        drawn_logit = tl.sum(tl.where(j == at, scaled, 0.0), 0)
        best = tl.argmax(m, 0)  # greedy: the first chunk holding the row's max, its first column
        best_col = tl.load(part_col + row * CHUNKS + best)
        tl.store(token + row, tl.where(greedy, best_col, drawn).to(tl.int64))
        tl.store(logp + row, tl.where(greedy, top, drawn_logit) - lse)

    return chunk_kernel, pick_kernel


def available(device: torch.device) -> bool:
    """The kernels run on this device: CUDA, with Triton installed. (On the CPU they run only
    under Triton's interpreter, which the tests use by calling ``draw`` directly.)"""
    import importlib.util

    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def draw(logits, temperature, counter, block: int = 4096, seeds=None, steps=None):
    """logits [R, V] (any float dtype, rows contiguous), temperature [R] (T <= 0: greedy),
    counter [1] int64 (the unseeded rows' key; the caller advances it), optionally ``seeds``
    [R] int64 (>= 0: the row's seed, -1: unseeded) with ``steps`` [R] (the index of the token
    drawn) -> (token [R] int64, logp [R] float32): a draw from softmax(logits / T) and its
    log-prob. A seeded row's draw depends only on its seed, its step and its logits."""
    R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = -(-V // block)
    dev = logits.device
    m, s = (torch.empty(R, chunks, dtype=torch.float32, device=dev) for _ in range(2))
    col = torch.empty(R, chunks, dtype=torch.int32, device=dev)
    token = torch.empty(R, dtype=torch.int64, device=dev)
    logp = torch.empty(R, dtype=torch.float32, device=dev)
    temperature = temperature.float()
    chunk_kernel, pick_kernel = _kernels()
    chunk_kernel[(R, chunks)](logits, logits.stride(0), temperature, m, s, col, V, chunks,
                              BLOCK=block)
    seeded = seeds is not None
    if seeded:
        seeds, steps = seeds.to(torch.int64).contiguous(), steps.to(torch.int64).contiguous()
    pick_kernel[(R,)](logits, logits.stride(0), temperature, counter,
                      seeds if seeded else counter, steps if seeded else counter, m, s, col,
                      token, logp, V, chunks, CP=max(2, 1 << (chunks - 1).bit_length()),
                      BLOCK=block, SEEDED=seeded, num_warps=8)
    return token, logp
