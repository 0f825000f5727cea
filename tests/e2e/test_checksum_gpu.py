"""The fused CUDA checksum pass (fsdpfn.wire.fused) equals the portable one bit for bit, on the
words a push can carry: random int32 (both signs, the extremes), bf16 weights, NaN bit patterns.

Skipped without CUDA or Triton."""

from __future__ import annotations

import pytest
import torch

from fsdpfn.wire import fused, protocol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or fused._kernel() is None,  # noqa: SLF001
    reason="needs a CUDA device and Triton")]


def _portable(rows: torch.Tensor):
    """The two-reduction path of protocol._row_terms, run on the CPU."""
    block = rows.cpu().view(-1, protocol._SIDE, protocol._SIDE)  # noqa: SLF001
    p = block.sum(2, dtype=torch.int32).to(torch.int64)
    q = block.sum(1, dtype=torch.int32).to(torch.int64)
    pos = torch.arange(protocol._SIDE, dtype=torch.int64)  # noqa: SLF001
    wrap = 1 << 32
    return p.sum(1) % wrap, (protocol._SIDE * (p * pos).sum(1) + (q * pos).sum(1)) % wrap  # noqa: SLF001


@pytest.mark.parametrize("n_rows", [1, 7, 8, 9, 1000, 4099])
def test_fused_row_terms_equal_the_portable_ones(n_rows):
    g = torch.Generator().manual_seed(n_rows)
    words = torch.randint(-2**31, 2**31 - 1, (n_rows, protocol._ROW), generator=g,  # noqa: SLF001
                          dtype=torch.int64).to(torch.int32)
    words[0, :4] = torch.tensor([2**31 - 1, -2**31, -1, 0], dtype=torch.int32)
    sums, weighted = fused.row_terms(words.cuda())
    want_s, want_w = _portable(words)
    assert torch.equal(sums.cpu(), want_s) and torch.equal(weighted.cpu(), want_w)


def test_flat_checksums_on_cuda_equal_the_cpu_ones():
    from fsdpfn.wire.protocol import bucket_layout, flat_checksums, padded_size

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g).to(torch.bfloat16) for s in (5, 4096, 12345, 3)]
    tensors[1][7] = float("nan")
    offsets, total = bucket_layout(["bfloat16"] * 4, [t.shape for t in tensors])
    buf = torch.zeros(padded_size(total), dtype=torch.uint8)
    for t, o in zip(tensors, offsets):
        buf[o:o + t.numel() * 2] = t.view(torch.uint8)
    sizes = [t.numel() * 2 for t in tensors]
    assert torch.equal(flat_checksums(buf.cuda(), offsets, sizes).cpu(),
                       flat_checksums(buf, offsets, sizes))
