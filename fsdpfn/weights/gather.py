"""The one gather schedule every transport uses, and the driver that overlaps it with sending.

All trainer ranks walk the same buckets in the same order (FSDP-sharded parameters of a bucket are
made whole by one all-gather, other sharded layouts by ``full_tensor()``); only rank 0 keeps what
it gathered. A bucket is the unit
held whole: the model is never gathered at once. The driver overlaps: rank 0 starts sending bucket
k, every rank gathers bucket k+1, rank 0 waits for bucket k, then every rank learns rank 0's verdict
(one all-reduce), so a failure stops every rank at the same bucket and none is left in a gather.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import attrs
import torch
import torch.distributed as dist

from fsdpfn.errors import WeightSyncError
from fsdpfn.state import EngineState, agree
from fsdpfn.weights.protocol import ALIGN, dtype_name, nbytes_of, padded_size

__all__ = ["TensorSpec", "Bucket", "weight_params", "plan_buckets", "gather_bucket",
           "iter_buckets", "is_pusher",
           "Sender", "drive", "guard", "share"]


@attrs.frozen
class TensorSpec:
    name: str  # the HF name (no "lm." prefix)
    shape: tuple[int, ...]
    dtype: torch.dtype  # the dtype sent, which is the dtype advertised

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


@attrs.frozen
class Bucket:
    index: int
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]  # byte offsets in the flat buffer (ALIGN-aligned)
    nbytes: int  # size of the flat buffer

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def metadata(self) -> dict:
        """names, dtypes, shapes: what is advertised ahead of the bytes."""
        return {"names": self.names, "dtypes": [dtype_name(s.dtype) for s in self.specs],
                "shapes": [list(s.shape) for s in self.specs]}


def is_pusher() -> bool:
    """Trainer rank 0 (of the default group) talks to the receivers; the others only gather."""
    return not dist.is_initialized() or dist.get_rank() == 0


def weight_params(state: EngineState) -> list[tuple[str, torch.nn.Parameter]]:
    """(HF name, parameter) in registration order: the same on every rank. Tied parameters
    appear once, under their first name (embed_tokens), as in the HF model's named_parameters."""
    return [(name.removeprefix("lm."), p) for name, p in state.model.named_parameters()]


def plan_buckets(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 bucket_bytes: int) -> list[Bucket]:
    """Greedy buckets in name order; a tensor larger than ``bucket_bytes`` gets a bucket alone."""
    buckets: list[Bucket] = []
    specs: list[TensorSpec] = []
    offsets: list[int] = []
    cursor = 0

    def close() -> None:
        nonlocal specs, offsets, cursor
        if specs:
            buckets.append(Bucket(len(buckets), tuple(specs), tuple(offsets), cursor))
        specs, offsets, cursor = [], [], 0

    for name, p in params:
        spec = TensorSpec(name, tuple(int(d) for d in p.shape), dtype)
        start = -(-cursor // ALIGN) * ALIGN
        if specs and start + spec.nbytes > bucket_bytes:
            close()
            start = 0
        specs.append(spec)
        offsets.append(start)
        cursor = start + spec.nbytes
    close()
    return buckets


def _full(p: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The whole parameter in ``dtype`` on ``device`` (a collective when ``p`` is a DTensor).

    The general path (tensor-parallel and 2-D placements). The local shard is cast before the
    gather, so the wire carries the push dtype only."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        local = p.to_local().detach().to(device=device, dtype=dtype)
        whole = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
        return whole.full_tensor()
    return p.detach().to(device=device, dtype=dtype)


def _layout_kind(p: torch.Tensor) -> tuple[str, Any]:
    """How a parameter is gathered: ("whole", None) when this rank holds all of it (a plain
    tensor, or a DTensor on a one-rank mesh), ("dim0", mesh) for FSDP's Shard(0) on a 1-D mesh
    (gathered with its bucket in one all-gather), ("general", None) otherwise (full_tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return "whole", None
    mesh = p.device_mesh
    if mesh.size() == 1:
        return "whole", None
    placement = p.placements[0] if len(p.placements) == 1 else None
    if (mesh.ndim == 1 and p.ndim >= 1 and type(placement) is Shard  # noqa: E721 - not _Strided
            and placement.dim == 0):
        return "dim0", mesh
    return "general", None


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p._local_tensor if hasattr(p, "_local_tensor") else p).detach()  # noqa: SLF001


def _gather_dim0(items: list[tuple[torch.Tensor, torch.Tensor | None]], mesh,
                 dtype: torch.dtype, device: torch.device) -> None:
    """One all-gather for every Shard(0) parameter of a bucket (as FSDP does per layer).

    items: (parameter, destination view or None off the keeping rank). Each rank's shard of a
    parameter with d0 rows holds rows [r*c, min((r+1)*c, d0)), c = ceil(d0 / W) (torch.chunk's
    split); shards are laid out at fixed offsets of one send buffer, padded to c rows."""
    world, rank = mesh.size(), mesh.get_local_rank()
    layout, total = [], 0
    for p, _ in items:
        d0 = int(p.shape[0])
        rest = p.numel() // d0 if d0 else 0
        c = -(-d0 // world)
        layout.append((total, d0, rest, c))
        total += c * rest
    send = torch.empty(total, dtype=dtype, device=device)
    for (p, _), (off, d0, rest, c) in zip(items, layout):
        local = _local(p)
        rows = max(0, min(c, d0 - rank * c))
        if local.numel() != rows * rest:
            raise RuntimeError(f"unexpected local shard of shape {tuple(local.shape)} for a "
                               f"parameter of shape {tuple(p.shape)} on rank {rank} of {world}")
        if local.numel():
            send[off:off + local.numel()].view_as(local).copy_(local)
    recv = torch.empty(world * total, dtype=dtype, device=device)
    dist.all_gather_into_tensor(recv, send, group=mesh.get_group())
    del send
    grid = recv.view(world, total)
    for (_, dst), (off, d0, rest, c) in zip(items, layout):
        if dst is None or not d0 * rest:
            continue
        chunk = c * rest
        flat_dst = dst.view(-1)
        full = d0 // c  # ranks whose shard is complete
        if full:
            flat_dst[:full * chunk].view(full, chunk).copy_(grid[:full, off:off + chunk])
        tail = d0 * rest - full * chunk
        if tail:
            flat_dst[full * chunk:].copy_(grid[full, off:off + tail])


def gather_bucket(params: dict[str, torch.Tensor], bucket: Bucket, *,
                  device: torch.device, keep: bool) -> torch.Tensor | None:
    """Every rank: gather ``bucket``'s parameters; the keeping rank gets its flat uint8 buffer
    (on ``device``, ``padded_size(bucket.nbytes)`` bytes, padding zero), the others None.

    Parameters a rank holds whole are cast straight into the buffer; FSDP-sharded ones are made
    whole by one all-gather per bucket; any other layout goes through DTensor.full_tensor. The
    order of collectives is the bucket's, the same on every rank."""
    buf = torch.zeros(padded_size(bucket.nbytes), dtype=torch.uint8, device=device) \
        if keep else None
    dim0: dict[int, tuple[Any, list]] = {}
    for spec, offset in zip(bucket.specs, bucket.offsets):
        p = params[spec.name]
        dst = (buf[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)
               if keep else None)
        kind, mesh = _layout_kind(p)
        if kind == "whole":
            if dst is not None:
                dst.copy_(_local(p))
        elif kind == "dim0":
            dim0.setdefault(id(mesh), (mesh, []))[1].append((p, dst))
        else:
            whole = _full(p, spec.dtype, device)
            if dst is not None:
                dst.copy_(whole)
            del whole
    for mesh, items in dim0.values():
        _gather_dim0(items, mesh, bucket.specs[0].dtype, device)
    return buf


def iter_buckets(params: dict[str, torch.Tensor], buckets: list[Bucket], *,
                 gather_device: torch.device, out_device: torch.device, keep: bool,
                 flat: bool) -> Iterator[tuple[Bucket, Any]]:
    """Gather bucket after bucket on every rank. Yields (bucket, data) where data is, on the rank
    that keeps, a flat uint8 buffer (``flat``) or a list of tensors; None elsewhere."""
    for bucket in buckets:
        buf = gather_bucket(params, bucket, device=gather_device, keep=keep)
        if buf is None:
            yield bucket, None
        elif flat:
            yield bucket, buf.to(out_device)
        else:
            yield bucket, [buf[o:o + s.nbytes].view(s.dtype).view(s.shape).to(out_device,
                                                                              copy=True)
                           for s, o in zip(bucket.specs, bucket.offsets)]
        del buf


class Sender(Protocol):
    """What a transport does on rank 0: start a bucket (returns a handle), finish it (raises
    WeightSyncError). Only rank 0 calls these. With ``start_before_finish`` the driver starts
    bucket k before finishing bucket k-1 (two in flight); else after."""

    def start(self, bucket: Bucket, data: Any) -> Any: ...

    def finish(self, handle: Any) -> None: ...


def guard(fn: Callable[[], Any], what: str) -> tuple[Any, WeightSyncError | None]:
    """Run ``fn`` on rank 0; any failure becomes a WeightSyncError to be agreed on."""
    try:
        return fn(), None
    except WeightSyncError as exc:
        return None, exc
    except Exception as exc:  # noqa: BLE001 - a bug or I/O error on rank 0 must not hang others
        return None, WeightSyncError(f"push_weights: {what} failed on trainer rank 0: "
                                     f"{type(exc).__name__}: {exc}")


def drive(state: EngineState, params: dict[str, torch.Tensor], buckets: list[Bucket],
          sender: Sender | None, *, gather_device: torch.device, out_device: torch.device,
          flat: bool) -> None:
    """Gather every bucket on every rank, overlapped with rank 0 sending the previous one.

    After each bucket every rank takes part in one verdict (rank 0's error or None); a failure
    raises WeightSyncError on every rank at the same bucket."""
    pusher = is_pusher()
    early = bool(getattr(sender, "start_before_finish", False))
    pending = None
    for bucket, data in iter_buckets(params, buckets, gather_device=gather_device,
                                     out_device=out_device, keep=pusher, flat=flat):
        error = None
        if pusher:
            handle = None
            if early:  # this bucket goes out before the previous one is confirmed
                handle, error = guard(lambda: sender.start(bucket, data),
                                      f"bucket {bucket.index}")
            if pending is not None:
                _, late = guard(lambda: sender.finish(pending), f"bucket {bucket.index - 1}")
                error = error or late
                pending = None
            if not early and error is None:
                handle, error = guard(lambda: sender.start(bucket, data),
                                      f"bucket {bucket.index}")
            pending = handle if error is None else None
        del data
        agree(state.mesh, error)
    error = None
    if pusher and pending is not None:
        _, error = guard(lambda: sender.finish(pending), f"bucket {len(buckets) - 1}")
    agree(state.mesh, error)


def share(value: Any, error: WeightSyncError | None) -> Any:
    """Rank 0's (value, error) on every rank (one collective); raises WeightSyncError on every
    rank when rank 0 has an error. Other ranks pass (None, None)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value, None if error is None else str(error)]
        dist.broadcast_object_list(box, src=0)
        value, message = box
        if message is not None:
            raise error if error is not None else WeightSyncError(
                f"(raised on rank 0) {message}")
    elif error is not None:
        raise error
    return value
