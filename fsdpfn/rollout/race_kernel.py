"""The decode loop's unseeded, untruncated draw in one pass over the logits (a Triton kernel).

``device_sampling.sample`` makes about nine passes over the [R, V] logits in float32 (the cast,
the scaling, the noise, its log, the race, two argmaxes, the logsumexp): at 512 rows of a
151,936-token vocabulary that is about 4.5 GB of memory traffic a step. This kernel reads the
model's logits once, in their own dtype, one program per (row, chunk of columns), and writes
per chunk what those passes produce: the scaled logits' max and sum of exponentials, the race's
best score and column (argmax of logit / T + Gumbel noise, the exponential race of ``sample``),
and the scaled logit at that column; a few small ops combine the chunks of each row. (One
program per row, looping over the vocabulary, took 0.86 ms a step at 512 rows on the H200:
too few programs to fill the GPU.) Greedy rows (T <= 0) race the logits without noise and report
log_softmax(logits), as ``sample`` does. Ties go to the first column, as torch's argmax.

The noise is Philox (``tl.rand``) keyed by a device step counter that the caller advances after
each draw, so a captured CUDA graph draws new noise on every replay. Rows with a seed or with
top-p / top-k keep ``sample`` (their graphs are captured separately).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["available", "race"]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def race_kernel(logits, stride, temperature, counter, part_m, part_s, part_best,
                    part_col, part_at, V, CHUNKS, BLOCK: tl.constexpr):
        """One program per (row, chunk of BLOCK columns): the chunk's max and sum of exp of the
        scaled logits, its best race score, that column and its scaled logit."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        t = tl.load(temperature + row)
        greedy = t <= 0
        t = tl.where(greedy, 1.0, t)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(logits + row.to(tl.int64) * stride + cols, mask=inside,
                    other=-float("inf")).to(tl.float32)
        scaled = x / t
        m = tl.max(scaled, 0)
        s = tl.sum(tl.where(inside, tl.exp(scaled - m), 0.0), 0)
        u = tl.rand(tl.load(counter), row * V + cols)  # uniform in [0, 1): -log(u) ~ Exp(1)
        score = tl.where(inside, tl.where(greedy, scaled, scaled - tl.log(-tl.log(u))),
                         -float("inf"))
        col = tl.argmax(score, 0)  # ties: the first column
        out = row * CHUNKS + chunk
        tl.store(part_m + out, m)
        tl.store(part_s + out, s)
        tl.store(part_best + out, tl.max(score, 0))
        tl.store(part_col + out, chunk * BLOCK + col)
        tl.store(part_at + out, tl.sum(tl.where(cols == chunk * BLOCK + col, scaled, 0.0), 0))

    return race_kernel


def available(device: torch.device) -> bool:
    """The kernel runs on this device: CUDA, with Triton installed. (On the CPU it runs only
    under Triton's interpreter, which the tests use by calling ``race`` directly.)"""
    import importlib.util

    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def race(logits, temperature, counter, block: int = 4096):
    """logits [R, V] (any float dtype, rows contiguous), temperature [R] float32, counter [1]
    int64 (the noise's key; the caller advances it) -> (token [R] int64, logp [R] float32).
    The chunks' partial results are combined on [R, chunks] (the first chunk wins ties)."""
    R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = -(-V // block)
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, s, best, at = (torch.empty(R, chunks, **f32) for _ in range(4))
    col = torch.empty(R, chunks, dtype=torch.int32, device=logits.device)
    _kernel()[(R, chunks)](logits, logits.stride(0), temperature.float(), counter, m, s, best,
                           col, at, V, chunks, BLOCK=block)
    top = m.max(1, keepdim=True).values
    lse = top[:, 0] + (s * (m - top).exp()).sum(1).log()
    win = best.argmax(1, keepdim=True)
    return col.gather(1, win)[:, 0].long(), at.gather(1, win)[:, 0] - lse
