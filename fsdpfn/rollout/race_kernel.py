"""The decode loop's unseeded, untruncated draw in one pass over the logits (a Triton kernel).

``device_sampling.sample`` makes about nine passes over the [R, V] logits in float32 (the cast,
the scaling, the noise, its log, the race, two argmaxes, the logsumexp): at 512 rows of a
151,936-token vocabulary that is about 4.5 GB of memory traffic a step. This kernel reads the
model's logits once, in their own dtype, one program per row, and keeps as running values what
those passes produce: the scaled logits' online logsumexp, the race's best value and column
(argmax of logit / T + Gumbel noise, the exponential race of ``sample``), and the scaled logit
at that column. Greedy rows (T <= 0) race the logits without noise and report
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
    def race_kernel(logits, stride, temperature, counter, token_out, logp_out, V,
                    BLOCK: tl.constexpr):
        row = tl.program_id(0)
        t = tl.load(temperature + row)
        greedy = t <= 0
        t = tl.where(greedy, 1.0, t)
        key = tl.load(counter)
        base = logits + row.to(tl.int64) * stride
        m = -float("inf")
        s = 0.0
        best = -float("inf")
        best_col = 0
        best_scaled = 0.0
        for start in tl.range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            x = tl.load(base + cols, mask=inside, other=-float("inf")).to(tl.float32)
            scaled = x / t
            block_max = tl.max(scaled, 0)
            m_new = tl.maximum(m, block_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(inside, tl.exp(scaled - m_new), 0.0), 0)
            m = m_new
            u = tl.rand(key, row * V + cols)  # uniform in [0, 1): E = -log(u) ~ Exp(1)
            gumbel = -tl.log(-tl.log(u))
            score = tl.where(inside, tl.where(greedy, scaled, scaled + gumbel), -float("inf"))
            block_best = tl.max(score, 0)
            col = tl.argmax(score, 0)
            take = block_best > best
            best = tl.where(take, block_best, best)
            best_col = tl.where(take, start + col, best_col)
            at = tl.sum(tl.where(cols == start + col, scaled, 0.0), 0)
            best_scaled = tl.where(take, at, best_scaled)
        tl.store(token_out + row, best_col.to(tl.int64))
        tl.store(logp_out + row, best_scaled - (m + tl.log(s)))

    return race_kernel


def available(device: torch.device) -> bool:
    """Triton runs on this device (CUDA; on the CPU only under TRITON_INTERPRET=1)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def race(logits, temperature, counter, block: int = 4096):
    """logits [R, V] (any float dtype, rows contiguous), temperature [R] float32, counter [1]
    int64 (the noise's key; the caller advances it) -> (token [R] int64, logp [R] float32)."""
    R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    token = torch.empty(R, dtype=torch.int64, device=logits.device)
    logp = torch.empty(R, dtype=torch.float32, device=logits.device)
    _kernel()[(R,)](logits, logits.stride(0), temperature.float(), counter, token, logp, V,
                    BLOCK=block)
    return token, logp
