"""The content checksum on a CUDA device equals the CPU's bit for bit: the fused Triton pass over
a push's 4 KiB rows (fsdpfn.wire.fused) against the portable float64 product, on the words a push
can carry (random int32 of both signs, the extremes, bf16 weights, NaN bit patterns); a flat
bucket's per-tensor values; and a checkpoint chunk's boxes (the portable path on the device).

Skipped without CUDA (the fused test also without Triton)."""

from __future__ import annotations

import pytest
import torch

from fsdpfn.wire import checksum, fused

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]


@pytest.mark.skipif(fused._kernel() is None, reason="needs Triton")  # noqa: SLF001
@pytest.mark.parametrize("n_rows", [1, 3, 4, 5, 1000, 4099])
def test_fused_row_values_equal_the_portable_ones(n_rows):
    g = torch.Generator().manual_seed(n_rows)
    words = torch.randint(-2**31, 2**31 - 1, (n_rows, 1024), generator=g,
                          dtype=torch.int64).to(torch.int32)
    words[0, :4] = torch.tensor([2**31 - 1, -2**31, -1, 0], dtype=torch.int32)
    rows = words.view(torch.int16)
    assert fused.usable(rows.cuda())
    assert torch.equal(checksum.row_hashes(rows.cuda()).cpu(), checksum.row_hashes(rows))
    weights = torch.randint(0, checksum.P, (n_rows,), generator=g, dtype=torch.int64)
    weights[0] = checksum.P - 1
    on_gpu = checksum.weighted_rows(rows.cuda(), weights.cuda())
    on_cpu = checksum.weighted_rows(rows, weights)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(on_gpu, on_cpu))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_chunk_boxes_on_cuda_equal_the_cpu_ones(dtype):
    t = (torch.randn(300, 70001, generator=torch.Generator().manual_seed(1)) * 1e3).to(dtype)
    for box, offsets in ((t, [0, 0]), (t[100:250, 5:60000], [100, 5])):
        assert int(checksum.box_hash(box.cuda(), t.shape, offsets)) == \
            int(checksum.box_hash(box, t.shape, offsets))
