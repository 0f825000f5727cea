"""One pass over 4 KiB rows of 16-bit units on a CUDA device: each row's checksum value
(fsdpfn.wire.checksum.row_hashes), optionally times a weight per row, in a single Triton kernel.

The portable path converts the units to float64 and takes a matrix product against the powers'
limbs, then a dozen small kernels reduce and weight the rows: several passes over a copy four
times the data, and many launches per bucket. Here each program reads a tile of rows once, splits
every int32 word into its two signed halfwords u (|u| <= 2**15) and sums u * c over the row in
int64, for the 31-bit low and the 30-bit high limb c of each position's power R**j: every product
is below 2**46 in size, a row's 2048 of them below 2**57, so the sums are exact. The row's value
modulo P = 2**61 - 1 (and its product with the row's weight) is then taken in registers, with
the same limb arithmetic as checksum.mulmod: the same numbers as the portable path, bit for bit
(tests/e2e/test_checksum_gpu.py).
"""

from __future__ import annotations

import functools

import torch

_TILE_ROWS = 2  # with 4 warps: the H200's read speed (a tile of 4 rows: half of it)


@functools.cache
def _kernel():
    """The compiled kernel, or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def fold(x):  # x modulo P for x in [0, 2**63)
        x = (x & 2305843009213693951) + (x >> 61)
        return tl.where(x >= 2305843009213693951, x - 2305843009213693951, x)

    @triton.jit
    def mulmod(x, y):  # x * y modulo P for x, y in [0, P), in 31-bit limbs
        x0, x1 = x & 2147483647, x >> 31
        y0, y1 = y & 2147483647, y >> 31
        mid = x1 * y0 + x0 * y1
        return fold(fold(x0 * y0) + 2 * (x1 * y1) + (mid >> 30) + ((mid & 1073741823) << 31))

    @triton.jit
    def row_values(words, even_lo, even_hi, odd_lo, odd_hi, weights, out_low, out_high,
                   n_rows, ROW: tl.constexpr, TILE: tl.constexpr, WEIGHTED: tl.constexpr):
        rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
        cols = tl.arange(0, ROW)
        live = rows < n_rows
        index = rows.to(tl.int64)[:, None] * ROW + cols[None, :]
        w = tl.load(words + index, mask=live[:, None], other=0)
        lo = ((w << 16) >> 16).to(tl.int64)  # the low halfword, sign-extended
        hi = (w >> 16).to(tl.int64)  # the high halfword (an arithmetic shift)
        e_lo = tl.load(even_lo + cols).to(tl.int64)[None, :]
        e_hi = tl.load(even_hi + cols).to(tl.int64)[None, :]
        o_lo = tl.load(odd_lo + cols).to(tl.int64)[None, :]
        o_hi = tl.load(odd_hi + cols).to(tl.int64)[None, :]
        a = tl.sum(lo * e_lo + hi * o_lo, axis=1)  # |a|, |b| < 2**57 < P
        b = tl.sum(lo * e_hi + hi * o_hi, axis=1)
        a = tl.where(a < 0, a + 2305843009213693951, a)
        b = tl.where(b < 0, b + 2305843009213693951, b)
        value = fold(a + ((b & 1073741823) << 31) + (b >> 30))  # a + b * 2**31 modulo P
        if WEIGHTED:
            value = mulmod(value, tl.load(weights + rows, mask=live, other=0))
        tl.store(out_low + rows, value & 2147483647, mask=live)
        tl.store(out_high + rows, value >> 31, mask=live)

    return row_values, triton.cdiv


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def usable(rows: torch.Tensor) -> bool:
    """Whether the kernel can run on the unit matrix ``rows`` [A, C]: Triton present, an int16
    contiguous CUDA tensor, C twice a power of two and at most 4096."""
    return rows.is_cuda and rows.is_contiguous() and rows.dtype == torch.int16 \
        and _power_of_two(rows.shape[1] // 2) and rows.shape[1] <= 4096 and _kernel() is not None


def row_values(rows: torch.Tensor, coefficients: tuple[torch.Tensor, ...],
               weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The checksum value v of each row of the int16 CUDA unit matrix ``rows`` [A, C] (times
    ``weights[a]`` modulo P when given, int64 [A] in [0, P)), as its 31-bit low and 30-bit high
    halves (int64 [A] each: v = low + high * 2**31). ``coefficients`` are the 31-bit low and
    30-bit high limbs of the powers R**(2b) and R**(2b+1) for the C / 2 words b of a row, int32
    (even low, even high, odd low, odd high), on rows' device; ``usable(rows)`` must hold."""
    kernel, cdiv = _kernel()
    n_rows, width = rows.shape
    low = torch.empty(n_rows, dtype=torch.int64, device=rows.device)
    high = torch.empty_like(low)
    if n_rows:
        kernel[(cdiv(n_rows, _TILE_ROWS),)](
            rows.view(torch.int32), *coefficients,
            weights if weights is not None else low, low, high, n_rows, ROW=width // 2,
            TILE=_TILE_ROWS, WEIGHTED=weights is not None, num_warps=4)
    return low, high
