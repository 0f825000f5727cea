"""The push gather (fsdpfn.weights.gather.gather_bucket) on real sharded layouts: FSDP2's uneven
Shard(0) splits (fewer rows than ranks, rows not divisible by the world size), Shard(1) and
Replicate DTensors, in float32 and cast to bfloat16. Reference: the whole tensors, built from one
seed on every rank before sharding, cast with a plain ``.to``; equality is exact."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.dist

SHAPES = [(1,), (3,), (5, 3), (2, 7), (7,), (4, 4), (9, 2, 3), (6, 5)]


def _rank_fn(dtype_name: str):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdpfn.weights.gather import gather_bucket, plan_buckets

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    whole = {f"w{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}
    module = nn.Module()
    for name, t in whole.items():
        module.register_parameter(name, nn.Parameter(t.clone()))
    fully_shard(module, mesh=mesh)
    params = dict(module.named_parameters())
    # layouts FSDP does not make: the general (full_tensor) path
    params["col"] = distribute_tensor(whole["w5"].clone(), mesh, [Shard(1)])
    params["rep"] = distribute_tensor(whole["w6"].clone(), mesh, [Replicate()])
    whole = {**whole, "col": whole["w5"], "rep": whole["w6"]}
    dtype = getattr(torch, dtype_name)
    order = list(params.items())
    buckets = plan_buckets(order, dtype, bucket_bytes=96)  # several buckets, mixed layouts
    keep = dist.get_rank() == 0
    got = {}
    for bucket in buckets:
        buf = gather_bucket(params, bucket, device=torch.device("cpu"), keep=keep)
        assert (buf is None) != keep
        if keep:
            for spec, off in zip(bucket.specs, bucket.offsets):
                got[spec.name] = buf[off:off + spec.nbytes].view(dtype).view(spec.shape).clone()
            padding = torch.ones(buf.numel(), dtype=torch.bool)  # padded to ALIGN
            for spec, off in zip(bucket.specs, bucket.offsets):
                padding[off:off + spec.nbytes] = False
            assert not buf[padding].any(), "padding between tensors must be zero"
    if keep:
        assert sorted(got) == sorted(whole) and len(buckets) > 2
        for name, t in whole.items():
            assert torch.equal(got[name], t.to(dtype)), name
    return len(buckets)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_bucket_equals_whole_tensors_on_2_ranks(spmd2, dtype):
    from fsdpfn.testing import run_spmd

    run_spmd(_rank_fn, 2, args=(dtype,), pool=spmd2, timeout=60)


@pytest.mark.timeout(120)
def test_gather_bucket_equals_whole_tensors_on_4_ranks_uneven(spmd4):
    from fsdpfn.testing import run_spmd

    run_spmd(_rank_fn, 4, args=("bfloat16",), pool=spmd4, timeout=60)


def test_flat_checksums_equal_per_tensor_checksums():
    """The one-pass bucket checksum against tensor_checksum of each tensor (odd byte counts
    included, which are summed as uint8)."""
    from fsdpfn.wire.protocol import (bucket_layout, dtype_from_name, flat_checksums,
                                      padded_size, tensor_checksum, zero_padding)

    g = torch.Generator().manual_seed(1)
    dtypes = ["bfloat16", "float32", "bfloat16", "float16", "float64", "bfloat16"]
    shapes = [[3, 5], [7], [1], [2, 33], [4], [64, 3]]
    offsets, total = bucket_layout(dtypes, shapes)
    buf = torch.randint(0, 255, (padded_size(total),), dtype=torch.uint8, generator=g)
    tensors = []
    for o, d, s in zip(offsets, dtypes, shapes):
        t = (torch.randn(s, generator=g) * 100).to(dtype_from_name(d))
        buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(s).copy_(t)
        tensors.append(t)
    sizes = [t.numel() * t.element_size() for t in tensors]
    buf[total:].zero_()
    zero_padding(buf, offsets, sizes)  # the random bytes between tensors must not count
    # flat_checksums holds int64 bit patterns; tensor_checksum the same 64 bits, unsigned
    flat = [v % 2 ** 64 for v in flat_checksums(buf, offsets, sizes).tolist()]
    assert flat == [tensor_checksum(t) for t in tensors]
