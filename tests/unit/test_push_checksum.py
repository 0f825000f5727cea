"""The push checksum (fsdpfn.wire.protocol) sees order: against an independent reference in
Python integers, as a whole-tensor sum and as a flat bucket's per-tensor sums, and as hypothesis
properties (a transposition of unequal words changes it; a flat bucket agrees with each tensor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.wire.protocol import (bucket_layout, combine_checksums, combine_on_device,
                                     flat_checksums, padded_size, tensor_checksum,
                                     tensor_checksums)
from fsdpfn.weights.sglang import pack

W = 2**32


def reference(t: torch.Tensor) -> int:
    """S + 2**32 W in Python integers: int32 words (bytes when not a multiple of 4)."""
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    words = list(raw) if len(raw) % 4 else [int(v) for v in np.frombuffer(raw, dtype="<i4")]
    s = sum(words) % W
    w = sum((j + 1) * v for j, v in enumerate(words)) % W
    return s + W * w


def _bucket(tensors):
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    offsets, total = bucket_layout(dtypes, [list(t.shape) for t in tensors])
    buf = torch.full((padded_size(total),), 0, dtype=torch.uint8)
    sizes = [t.numel() * t.element_size() for t in tensors]
    for t, o, n in zip(tensors, offsets, sizes):
        buf[o:o + n] = t.contiguous().view(-1).view(torch.uint8)
    return buf, offsets, sizes


@pytest.mark.parametrize("numel,dtype", [(1, torch.float32), (1023, torch.float32),
                                         (1024, torch.float32), (5000, torch.float32),
                                         (3000, torch.bfloat16), (4097, torch.bfloat16),
                                         (7, torch.float64)])
def test_checksum_equals_reference_whole_and_in_a_bucket(numel, dtype):
    g = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=g) * 100).to(dtype)
    assert tensor_checksum(t) == reference(t)
    other = torch.randn(333, generator=g)
    buf, offsets, sizes = _bucket([other, t, other])
    got = [v % 2**64 for v in flat_checksums(buf, offsets, sizes).tolist()]
    assert got == [reference(other), reference(t), reference(other)]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.integers(2, 3000), st.data())
def test_a_transposition_of_unequal_words_changes_the_checksum(n, data):
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1).filter(lambda j: j != i))
    t = torch.randn(n, generator=torch.Generator().manual_seed(n))
    swapped = t.clone()
    swapped[i], swapped[j] = t[j], t[i]
    words = t.view(torch.int32)
    # a swap moves W by (i - j)(w_j - w_i) modulo 2**32: nonzero for random float words
    assert ((i - j) * (int(words[j]) - int(words[i]))) % W != 0
    assert tensor_checksum(swapped) != tensor_checksum(t)
    buf, offsets, sizes = _bucket([t])
    buf2, _, _ = _bucket([swapped])
    assert flat_checksums(buf, offsets, sizes).tolist() != \
        flat_checksums(buf2, offsets, sizes).tolist()


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(1, 2500), min_size=1, max_size=5), st.integers(0, 2**16))
def test_flat_bucket_agrees_with_each_tensor_and_combines_on_device(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=g) for n in sizes]
    buf, offsets, nbytes = _bucket(tensors)
    flat = flat_checksums(buf, offsets, nbytes)
    assert [v % 2**64 for v in flat.tolist()] == tensor_checksums(tensors)
    names = [f"t{(k * 7) % len(tensors)}.{k}" for k in range(len(tensors))]
    assert int(combine_on_device(flat, names)) == \
        combine_checksums(dict(zip(names, tensor_checksums(tensors))))


def test_a_permutation_inside_a_tensor_changes_the_combined_checksum():
    g = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(64, 64, generator=g), "b": torch.randn(4096, generator=g)}
    before = combine_checksums({n: tensor_checksum(t) for n, t in weights.items()})
    for perm in (lambda t: t.t().contiguous(), lambda t: t.flatten().roll(1).view(t.shape)):
        moved = dict(weights, a=perm(weights["a"]))
        assert combine_checksums({n: tensor_checksum(t) for n, t in moved.items()}) != before


def test_pack_is_sglang_flattened_bucket_layout():
    """SGLang's FlattenedTensorBucket: torch.cat of the flattened tensors, no padding."""
    from fsdpfn.weights.gather import plan_buckets

    g = torch.Generator().manual_seed(1)
    params = [("x", torch.randn(3, 5, generator=g)), ("y", torch.randn(7, generator=g))]
    (bucket,) = plan_buckets(params, torch.float32, 1 << 20)
    buf, _, _ = _bucket([p for _, p in params])
    packed = pack(buf, bucket)
    assert packed.dtype == torch.float32
    assert torch.equal(packed, torch.cat([p.flatten() for _, p in params]))
