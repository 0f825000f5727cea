"""The one gather schedule every transport uses, and the driver that overlaps it with sending.

All trainer ranks walk the same buckets in the same order, calling ``full_tensor()`` on each
parameter (a collective) one at a time; only rank 0 keeps what it gathered. A bucket is the unit
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
from fsdpfn.weights.protocol import ALIGN, dtype_name, nbytes_of

__all__ = ["TensorSpec", "Bucket", "weight_params", "plan_buckets", "iter_buckets", "is_pusher",
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

    The local shard is cast before the gather, so the wire carries the push dtype only."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        local = p.to_local().detach().to(device=device, dtype=dtype)
        whole = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
        return whole.full_tensor()
    return p.detach().to(device=device, dtype=dtype)


def iter_buckets(params: dict[str, torch.Tensor], buckets: list[Bucket], *,
                 gather_device: torch.device, out_device: torch.device, keep: bool,
                 flat: bool) -> Iterator[tuple[Bucket, Any]]:
    """Gather bucket after bucket on every rank. Yields (bucket, data) where data is, on the rank
    that keeps, a flat uint8 buffer (``flat``) or a list of tensors; None elsewhere."""
    for bucket in buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=out_device) if keep and flat \
            else None
        tensors = []
        for spec, offset in zip(bucket.specs, bucket.offsets):
            whole = _full(params[spec.name], spec.dtype, gather_device)
            if not keep:
                continue
            if flat:
                buf[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape).copy_(whole)
            else:
                tensors.append(whole.to(out_device))
            del whole
        yield bucket, (buf if flat else tensors) if keep else None


class Sender(Protocol):
    """What a transport does on rank 0: start a bucket (returns a handle), finish it (raises
    WeightSyncError), abort after a failure. Only rank 0 calls these."""

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
    pending = None
    for bucket, data in iter_buckets(params, buckets, gather_device=gather_device,
                                     out_device=out_device, keep=pusher, flat=flat):
        error = None
        if pusher:
            if pending is not None:
                _, error = guard(lambda: sender.finish(pending), f"bucket {bucket.index - 1}")
                pending = None
            if error is None:
                pending, error = guard(lambda: sender.start(bucket, data),
                                       f"bucket {bucket.index}")
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
