"""One pass over a flat bucket's 4 KiB rows on a CUDA device: each row's share of the push
checksum (fsdpfn.wire.checksum.row_hashes) in a single Triton kernel.

The portable path converts the rows' halfwords to float64 and takes a matrix product against the
powers' limbs: several passes over a copy four times the data. Here each program reads a tile of
rows once, splits every int32 word into its two signed halfwords u (|u| <= 2**15) and sums u * c
over the row in int64, for the 31-bit low and the 30-bit high limb c of each position's power
R**j: every product is below 2**46 in size, a row's 2048 of them below 2**57, so the sums are
exact, and ``row_hashes`` reduces them modulo P: the same numbers as the portable path, bit for bit
(tests/e2e/test_checksum_gpu.py).
"""

from __future__ import annotations

import functools

import torch

_TILE_ROWS = 2  # with 4 warps: the H200's read speed (tile 4: half of it)


@functools.cache
def _kernel():
    """The compiled kernel, or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_limb_sums(words, even_lo, even_hi, odd_lo, odd_hi, out_lo, out_hi, n_rows,
                      ROW: tl.constexpr, TILE: tl.constexpr):
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
        tl.store(out_lo + rows, tl.sum(lo * e_lo + hi * o_lo, axis=1), mask=live)
        tl.store(out_hi + rows, tl.sum(lo * e_hi + hi * o_hi, axis=1), mask=live)

    return row_limb_sums, triton.cdiv


@functools.lru_cache(maxsize=16)
def _coefficients(width: int, device: str) -> tuple[torch.Tensor, ...]:
    """The limbs of R**(2b) and R**(2b+1) for the words b of a row of ``width`` halfwords."""
    from fsdpfn.wire.checksum import powers, ROOT

    pw = powers(ROOT, width, device)
    even, odd = pw[0::2], pw[1::2]
    mask = (1 << 31) - 1
    return tuple((x & mask if k == 0 else x >> 31).to(torch.int32).contiguous()
                 for x in (even, odd) for k in (0, 1))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def row_limb_sums(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sum of u * low limb, sum of u * high limb) of each row of the int16 CUDA unit matrix
    ``rows`` [A, C] (C even), int64 [A] each; None where the kernel cannot run (no Triton, not
    CUDA, not contiguous, a width that is not twice a power of two up to 4096)."""
    found = _kernel() if rows.is_cuda and rows.is_contiguous() and rows.dtype == torch.int16 \
        and _power_of_two(rows.shape[1] // 2) and rows.shape[1] <= 4096 else None
    if found is None:
        return None
    kernel, cdiv = found
    n_rows, width = rows.shape
    words = rows.view(torch.int32)
    lo = torch.empty(n_rows, dtype=torch.int64, device=rows.device)
    hi = torch.empty_like(lo)
    if n_rows:
        kernel[(cdiv(n_rows, _TILE_ROWS),)](words, *_coefficients(width, str(rows.device)), lo,
                                             hi, n_rows, ROW=width // 2, TILE=_TILE_ROWS,
                                             num_warps=4)
    return lo, hi
