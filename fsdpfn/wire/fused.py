"""One pass over a flat bucket's words on a CUDA device: the per-row sum and column-weighted sum
of the push checksum (fsdpfn.wire.protocol._row_terms) in a single Triton kernel.

The portable path takes two reductions of the whole buffer (row marginals p and q) and a dozen
small kernels; on a GPU that halves the checks' speed, and the checks share the memory with the
broadcast they run beside. Here each program reads a tile of rows once and sums ``w`` and
``col * w`` in int32, whose two's-complement wrapping is exact modulo 2**32: the same numbers as
the portable path, bit for bit (tests/e2e/test_checksum_gpu.py).
"""

from __future__ import annotations

import functools

import torch

_WRAP = 1 << 32
_TILE_ROWS = 8


@functools.cache
def _kernel():
    """The compiled kernel, or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_terms(words, sums, weighted, n_rows, ROW: tl.constexpr, TILE: tl.constexpr):
        rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
        cols = tl.arange(0, ROW)
        live = rows < n_rows
        index = rows.to(tl.int64)[:, None] * ROW + cols[None, :]
        w = tl.load(words + index, mask=live[:, None], other=0)
        tl.store(sums + rows, tl.sum(w, axis=1), mask=live)
        tl.store(weighted + rows, tl.sum(w * cols[None, :], axis=1), mask=live)

    return row_terms, triton.cdiv


def row_terms(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sum, column-weighted sum) of each row of int32 CUDA ``rows`` [R, C], int64 [R] in
    [0, 2**32); None where the kernel cannot run (no Triton, not CUDA, not contiguous)."""
    found = _kernel() if rows.is_cuda and rows.is_contiguous() else None
    if found is None:
        return None
    kernel, cdiv = found
    n_rows, width = rows.shape
    sums = torch.empty(n_rows, dtype=torch.int32, device=rows.device)
    weighted = torch.empty_like(sums)
    if n_rows:
        kernel[(cdiv(n_rows, _TILE_ROWS),)](rows, sums, weighted, n_rows, ROW=width,
                                             TILE=_TILE_ROWS)
    return sums.to(torch.int64) % _WRAP, weighted.to(torch.int64) % _WRAP
