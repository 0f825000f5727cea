"""The one gather schedule every transport uses, and the driver that overlaps it with sending.

All trainer ranks walk the same buckets in the same order (FSDP-sharded parameters of a bucket are
made whole by one all-gather, other sharded layouts by ``full_tensor()``); only rank 0 keeps what
it gathered. A bucket is the unit
held whole: the model is never gathered at once. The driver overlaps: rank 0 sends the buckets
gathered so far (up to twice the largest bucket in flight) while every rank gathers the next one;
after each bucket every rank learns rank 0's verdict (one all-reduce), so a failure stops every
rank at the same bucket and none is left in a gather.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fsdpfn.engine import lora
from fsdpfn.engine import timing
from fsdpfn.errors import WeightSyncError
from fsdpfn.agree import agree_on_error, capture_error, is_rank_zero
from fsdpfn.engine.state import EngineState, param_index
from fsdpfn.wire.protocol import ALIGN, dtype_name, nbytes_of, padded_size, zero_padding

# torch 2.13 renamed all_gather_into_tensor (the old name warns on every push)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["TensorSpec", "Bucket", "weight_params", "weights_and_layout", "plan_buckets",
           "gather_bucket", "Sender", "send", "gather_and_send"]


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
    sizes: tuple[int, ...] = attrs.field(default=None)  # bytes of each tensor

    def __attrs_post_init__(self):
        if self.sizes is None:
            object.__setattr__(self, "sizes", tuple(s.nbytes for s in self.specs))

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def metadata(self) -> dict:
        """names, dtypes, shapes: what is advertised ahead of the bytes."""
        return {"names": self.names, "dtypes": [dtype_name(s.dtype) for s in self.specs],
                "shapes": [list(s.shape) for s in self.specs]}


def weight_params(state: EngineState) -> list[tuple[str, torch.nn.Parameter]]:
    """(HF name, parameter) in registration order: the same on every rank. Tied parameters
    appear once, under their first name (embed_tokens), as in the HF model's named_parameters.
    The list is shared between calls: do not change it."""
    return weights_and_layout(state)[0]


def weights_and_layout(state: EngineState):
    """(weight_params(state), ((HF name, shape), ...)): the layout is what a receiver's view of
    the pushed bytes depends on. Both are remembered with the model's ParamIndex."""
    index = param_index(state.model)
    if "weights" not in index.extra:
        params = [(name.removeprefix("lm."), p) for name, p in index.named]
        if state.config.lora is not None:  # base names, adapters folded in (lora.MergedWeight)
            params = lora.merged_params(params, state.config.lora)
        index.extra["weights"] = (params, tuple((n, tuple(p.shape)) for n, p in params))
    return index.extra["weights"]


def plan_buckets(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 bucket_bytes: int, edge_bytes: int | None = None) -> list[Bucket]:
    """Buckets of at most ``bucket_bytes`` (a tensor larger than that gets a bucket alone), the
    same on every rank (a pure function of names and shapes).

    Without ``edge_bytes``: greedy in name order. With it, the buckets ramp up and down: the
    first and the last hold at most ``edge_bytes``, the next ones in 4x as much, and so on up to
    ``bucket_bytes`` in the middle. A push then has bytes on the wire after gathering a small
    first bucket, and the receiver's checks of the last bucket are short: the fixed costs at
    both ends of the transfer shrink. A tensor too large for a ramp bucket moves to the next
    bucket that can hold it (the order is still fixed)."""
    specs = [TensorSpec(name, tuple(int(d) for d in p.shape), dtype) for name, p in params]
    sizes = [padded_size(s.nbytes) for s in specs]
    caps = []
    if edge_bytes:
        cap = int(edge_bytes)
        while cap < bucket_bytes:
            caps.append(cap)
            cap *= 4
    tail = _ramp(list(range(len(specs)))[::-1], sizes, caps)
    in_tail = {i for group in tail for i in group}
    head = _ramp([i for i in range(len(specs)) if i not in in_tail], sizes, caps)
    placed = in_tail | {i for group in head for i in group}
    middle: list[list[int]] = []
    cursor = 0  # the end of the last tensor of the open bucket
    for i in (i for i in range(len(specs)) if i not in placed):
        start = -(-cursor // ALIGN) * ALIGN
        if not middle or (middle[-1] and start + specs[i].nbytes > bucket_bytes):
            middle.append([])
            start = 0
        middle[-1].append(i)
        cursor = start + specs[i].nbytes
    buckets = []
    for group in head + middle + tail[::-1]:
        group = sorted(group)
        offsets, cursor = [], 0
        for i in group:
            cursor = -(-cursor // ALIGN) * ALIGN
            offsets.append(cursor)
            cursor += specs[i].nbytes
        buckets.append(Bucket(len(buckets), tuple(specs[i] for i in group), tuple(offsets),
                              cursor))
    return buckets


def _ramp(order: list[int], sizes: list[int], caps: list[int]) -> list[list[int]]:
    """Groups taken from the front of ``order``, the k-th holding at most caps[k] bytes: each
    takes the items in order while they fit, passing over one larger than its cap (left for a
    later group) and stopping at the first that would fit an empty group but not this one."""
    groups, left = [], list(order)
    for cap in caps:
        group, used, rest = [], 0, []
        for pos, i in enumerate(left):
            if sizes[i] > cap:
                rest.append(i)
            elif used + sizes[i] <= cap:
                group.append(i)
                used += sizes[i]
            else:
                rest.extend(left[pos:])
                break
        if group:
            groups.append(group)
        left = rest
        if not left:
            break
    return groups


def _full(p: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The whole parameter in ``dtype`` on ``device`` (a collective when ``p`` is a DTensor).

    The general path (tensor-parallel and 2-D placements). The local shard is cast before the
    gather, so the wire carries the push dtype only."""
    if isinstance(p, DTensor):
        local = p.to_local().detach().to(device=device, dtype=dtype)
        whole = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
        return whole.full_tensor()
    return p.detach().to(device=device, dtype=dtype)


def _layout_kind(p: torch.Tensor, sizes: dict[int, int]) -> tuple[str, Any]:
    """How a parameter is gathered: ("whole", None) when this rank holds all of it (a plain
    tensor, or a DTensor on a one-rank mesh), ("dim0", mesh) for FSDP's Shard(0) on a 1-D mesh
    (gathered with its bucket in one all-gather), ("general", None) otherwise (full_tensor).
    ``sizes``: the caller's mesh sizes by id(mesh), filled here (DeviceMesh.size() walks the
    mesh's layout on every call, and a bucket asks once per parameter)."""
    if not isinstance(p, DTensor):
        return "whole", None
    mesh = p.device_mesh
    if id(mesh) not in sizes:
        sizes[id(mesh)] = mesh.size()
    if sizes[id(mesh)] == 1:
        return "whole", None
    placement = p.placements[0] if len(p.placements) == 1 else None
    if (mesh.ndim == 1 and p.ndim >= 1 and type(placement) is Shard  # noqa: E721 - not _Strided
            and placement.dim == 0):
        return "dim0", mesh
    return "general", None


@functools.lru_cache(maxsize=4096)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


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
    _all_gather_single(recv, send, group=mesh.get_group())
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
    with torch.no_grad(), timing.region("gather"):  # PushReceipt.gather_s
        return _gather_bucket(params, bucket, device, keep)


def _gather_bucket(params, bucket: Bucket, device: torch.device, keep: bool):
    buf = torch.empty(padded_size(bucket.nbytes), dtype=torch.uint8, device=device) \
        if keep else None
    typed = buf.view(bucket.specs[0].dtype) if keep else None  # one dtype per bucket
    size = bucket.specs[0].dtype.itemsize
    dim0: dict[int, tuple[Any, list]] = {}
    sizes: dict[int, int] = {}  # by id(mesh): the parameters' meshes live through the bucket
    whole_dst, whole_src = [], []  # copied by one multi-tensor call (casting) per bucket
    for spec, offset in zip(bucket.specs, bucket.offsets):
        p = params[spec.name]
        dst = typed.as_strided(spec.shape, _strides(spec.shape), offset // size) \
            if keep else None
        kind, mesh = _layout_kind(p, sizes)
        if isinstance(p, lora.MergedWeight):
            whole = p.full(spec.dtype, device)
            if dst is not None:
                dst.copy_(whole)
            del whole
        elif kind == "whole":
            if dst is not None:
                whole_dst.append(dst)
                whole_src.append(p._local_tensor if isinstance(p, DTensor) else p)  # noqa: SLF001
        elif kind == "dim0":
            dim0.setdefault(id(mesh), (mesh, []))[1].append((p, dst))
        else:
            whole = _full(p, spec.dtype, device)
            if dst is not None:
                dst.copy_(whole)
            del whole
    if whole_dst:
        if all(t.is_contiguous() for t in whole_src):
            torch._foreach_copy_(whole_dst, whole_src)  # a few kernels, not one per tensor
        else:
            for dst, src in zip(whole_dst, whole_src):
                dst.copy_(src)
    for mesh, items in dim0.values():
        _gather_dim0(items, mesh, bucket.specs[0].dtype, device)
    if buf is not None:  # the bytes between and after the tensors are zero
        buf[bucket.nbytes:].zero_()
        zero_padding(buf, bucket.offsets, bucket.sizes)
    return buf


class Sender(Protocol):
    """What a transport does on trainer rank 0 (the only rank that calls these); the update
    channel, SGLang's protocol, CUDA IPC and disk each implement it.

    ``flat``: whether a bucket arrives as its flat uint8 buffer (ALIGN-padded, see
    fsdpfn.wire.protocol), else as a list of its tensors. ``start(bucket, data)`` puts one
    gathered bucket on its way and returns a handle; ``finish(handle)`` waits until that bucket
    is done (raises WeightSyncError). With ``start_before_finish`` the driver starts buckets
    before finishing the ones before them (see gather_and_send); else after. ``conclude()``,
    after the last bucket, completes the update and checks it (the servers' answers, versions,
    checksums); ``abandon()``, after any failure, leaves nothing half done (the group retired,
    generation resumed, buffers or files released)."""

    flat: bool
    start_before_finish: bool

    def start(self, bucket: Bucket, data: Any) -> Any: ...

    def finish(self, handle: Any) -> None: ...

    def conclude(self) -> None: ...

    def abandon(self) -> None: ...


def send(state: EngineState, params, buckets: list[Bucket], sender: Sender | None, *,
         out_device: torch.device) -> tuple[int, int]:
    """Collective, the one driver of every transport: every rank gathers the buckets in order,
    rank 0's ``sender`` (None on the other ranks) sends each, then concludes; every rank agrees
    on the verdict, and on any failure the sender abandons. Returns (n_tensors, n_bytes)."""
    flat = bool(getattr(sender, "flat", True)) if sender is not None else True
    try:
        gather_and_send(state, dict(params), buckets, sender,
                        gather_device=state.mesh.device, out_device=out_device, flat=flat)
        error = None
        if sender is not None:
            _, error = capture_error(sender.conclude, "concluding the push")
        agree_on_error(state.mesh, error)
    except BaseException:
        if sender is not None:
            sender.abandon()
        raise
    return sum(len(b.specs) for b in buckets), sum(sum(b.sizes) for b in buckets)


def gather_and_send(state: EngineState, params: dict[str, torch.Tensor],
                    buckets: list[Bucket], sender: Sender | None, *,
                    gather_device: torch.device, out_device: torch.device,
                    flat: bool) -> None:
    """Gather every bucket on every rank, overlapped with rank 0 sending the ones before.

    With ``sender.start_before_finish``, buckets go out without waiting for the ones before
    them, as long as the buckets in flight plus the one being gathered hold at most twice the
    largest bucket (the memory bound: two full buckets; small buckets at the ends of a ramped
    plan travel several at a time). Otherwise bucket k goes out once bucket k-1 is finished
    (gathered while k-1 is on the wire). After each bucket every rank takes part in one verdict
    (rank 0's error or None); a failure raises WeightSyncError on every rank at the same
    bucket."""
    pusher = is_rank_zero()
    early = bool(getattr(sender, "start_before_finish", False))
    budget = 2 * max((b.nbytes for b in buckets), default=0)
    pending: list[tuple[Any, Bucket]] = []
    in_flight = 0

    def finish_oldest() -> WeightSyncError | None:
        nonlocal in_flight
        handle, done = pending.pop(0)
        in_flight -= done.nbytes
        return capture_error(lambda: sender.finish(handle), f"bucket {done.index}")[1]

    for bucket in buckets:
        error = None
        while pusher and early and pending and error is None \
                and in_flight + bucket.nbytes > budget:
            error = finish_oldest()
        buf = gather_bucket(params, bucket, device=gather_device, keep=pusher)
        while pusher and not early and pending and error is None:
            error = finish_oldest()
        if pusher and error is None:
            data = buf.to(out_device) if flat else [
                buf[o:o + s.nbytes].view(s.dtype).view(s.shape).to(out_device, copy=True)
                for s, o in zip(bucket.specs, bucket.offsets)]
            try:
                pending.append((sender.start(bucket, data), bucket))
                in_flight += bucket.nbytes
            except Exception as exc:  # noqa: BLE001 - a verdict the other ranks learn
                error = _as_sync_error(exc, f"bucket {bucket.index}")
            del data
        del buf
        agree_on_error(state.mesh, error)
    error = None
    while pusher and pending and error is None:
        error = finish_oldest()
    agree_on_error(state.mesh, error)


def _as_sync_error(exc: Exception, what: str) -> WeightSyncError:
    """``exc`` as the WeightSyncError every rank raises (agree.capture_error's wording)."""
    if isinstance(exc, WeightSyncError):
        return exc
    return WeightSyncError(f"push_weights: {what} failed on trainer rank 0: "
                           f"{type(exc).__name__}: {exc}")
