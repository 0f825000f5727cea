"""The push checksum (fsdpfn.wire.protocol, on fsdpfn.wire.checksum) against an independent
reference in Python integers, for a whole tensor and for a flat bucket's per-tensor values; as
hypothesis properties (a transposition of unequal words changes it; a flat bucket agrees with
each tensor); and the errors it must catch: the sign-bit pair that fooled the earlier sums."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.wire.protocol import (bucket_layout, combine_checksums, combine_on_device,
                                  flat_checksums, padded_size, tensor_checksum, tensor_checksums)
from fsdpfn.weights.sglang import pack

P = 2**61 - 1
ROOT = 0x1F0E5C2B3A49D68A


def reference(t: torch.Tensor) -> int:
    """sum_j u_j * ROOT**j modulo 2**61 - 1 in Python integers: u_j the little-endian signed
    16-bit halfwords of the bytes (the bytes themselves when their count is odd)."""
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    units = list(raw) if len(raw) % 2 else [int(v) for v in np.frombuffer(raw, dtype="<i2")]
    return sum(u * pow(ROOT, j, P) for j, u in enumerate(units)) % P


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
                                         (2049, torch.float32),
                                         (3000, torch.bfloat16), (4097, torch.bfloat16),
                                         (7, torch.float64)])
def test_checksum_equals_reference_whole_and_in_a_bucket(numel, dtype):
    g = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=g) * 100).to(dtype)
    assert tensor_checksum(t) == reference(t)
    other = torch.randn(333, generator=g)
    buf, offsets, sizes = _bucket([other, t, other])
    got = flat_checksums(buf, offsets, sizes).tolist()
    assert got == [reference(other), reference(t), reference(other)]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.integers(2, 3000), st.data())
def test_a_transposition_of_unequal_words_changes_the_checksum(n, data):
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1).filter(lambda j: j != i))
    t = torch.randn(n, generator=torch.Generator().manual_seed(n))
    swapped = t.clone()
    swapped[i], swapped[j] = t[j], t[i]
    assert not torch.equal(t[i], t[j])  # random floats: a swap changes the bytes
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
    assert flat.tolist() == tensor_checksums(tensors)
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


def test_two_negated_q_proj_weights_change_the_push_checksum():
    """Two weights of a q_proj negated (their sign bits flipped, positions i and i + 2): the
    earlier sum and position-weighted sum modulo 2**32 both moved by multiples of 2**32 and
    missed it; the checksum of the tensor, of its flat bucket and the combined one all differ."""
    from fsdpfn.testing import tiny_qwen2_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config())
    q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    bad = q.clone()
    bad.view(-1)[[10, 12]] *= -1
    old = [(lambda w: (sum(w) % 2**32, sum((j + 1) * v for j, v in enumerate(w)) % 2**32))(
        [int(v) for v in x.view(-1).view(torch.int32).tolist()]) for x in (q, bad)]
    assert old[0] == old[1]  # the earlier scheme cannot see it
    assert tensor_checksum(bad) != tensor_checksum(q)
    assert reference(bad) == tensor_checksum(bad)
    buf, offsets, sizes = _bucket([q])
    buf2, _, _ = _bucket([bad])
    assert flat_checksums(buf, offsets, sizes).tolist() != \
        flat_checksums(buf2, offsets, sizes).tolist()
    assert combine_checksums({"q": tensor_checksum(q)}) != \
        combine_checksums({"q": tensor_checksum(bad)})
