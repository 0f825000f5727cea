"""transport="ipc" of a RolloutTarget (servers on trainer rank 0's own GPU, where NCCL cannot
connect the two processes): rank 0 packs each gathered bucket into a device buffer and sends the
servers their CUDA IPC handles in one /update_weights_from_ipc request; each server copies the
tensors out on the device, checks and commits as for a whole update, and the buffers are freed
after its answer. The handle format lives in fsdpfn.wire.ipc."""

from __future__ import annotations

import time

import torch

from fsdpfn.agree import agree_on_error, capture_error, is_rank_zero
from fsdpfn.errors import ConfigError
from fsdpfn.state import EngineState
from fsdpfn.weights.gather import Bucket, gather_and_send
from fsdpfn.weights.senders import PushTimings
from fsdpfn.weights.servers import Servers, check_commit
from fsdpfn.wire.http import call
from fsdpfn.wire.ipc import device_uuid, open_shared, share, unpack
from fsdpfn.wire.protocol import combine_checksums, dtype_name, tensor_checksums

__all__ = ["share", "open_shared", "device_uuid", "IpcSender", "unpack", "push_ipc"]


class IpcSender:
    """Rank 0's side of gather_and_send() for an IPC push: each gathered bucket packed back to
    back into a device buffer of its own (kept alive until release()), its handle and per-tensor
    checksums recorded. ``update`` is the request body for /update_weights_from_ipc (without the
    version)."""

    start_before_finish = True

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.buckets: list[dict] = []
        self.checksums: dict[str, int] = {}

    def start(self, bucket, tensors: list[torch.Tensor]):
        views = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
        buffer = torch.cat(views) if views else torch.empty(0, dtype=torch.uint8,
                                                            device=tensors[0].device)
        self.buffers.append(buffer)
        names = [s.name for s in bucket.specs]
        self.checksums.update(zip(names, tensor_checksums(tensors)))
        self.buckets.append({"names": names, "dtypes": [dtype_name(s.dtype) for s in bucket.specs],
                             "shapes": [list(s.shape) for s in bucket.specs],
                             "handle": share(buffer)})

    def finish(self, handle) -> None:
        return None

    def release(self) -> None:
        self.buffers.clear()


def push_ipc(state: EngineState, params, buckets: list[Bucket], servers: Servers,
             timings: PushTimings) -> tuple[int, int]:
    """Collective: every rank gathers; rank 0 packs each bucket into a device buffer of its own
    and hands the servers (on rank 0's GPU) their IPC handles in one /update_weights_from_ipc
    request; the buffers are freed once every server answered."""
    if state.mesh.device_type != "cuda":
        raise ConfigError(f"transport: 'ipc' shares CUDA memory and this trainer runs on "
                          f"{state.mesh.device_type}; use 'broadcast' or 'disk', got 'ipc'")
    sender = IpcSender() if is_rank_zero() else None
    try:
        clock = time.perf_counter()
        gather_and_send(state, dict(params), buckets, sender,
                        gather_device=state.mesh.device, out_device=state.mesh.device,
                        flat=False)
        error = None
        if sender is not None:
            _, error = capture_error(lambda: _load(servers, sender, state.version),
                                     "updating over CUDA IPC")
        agree_on_error(state.mesh, error)
        timings.seconds["transfer"] = time.perf_counter() - clock
    finally:
        if sender is not None:
            sender.release()
    return sum(len(b.specs) for b in buckets), sum(sum(b.sizes) for b in buckets)


def _load(servers: Servers, sender: IpcSender, version: int) -> None:
    torch.cuda.current_stream().synchronize()  # the buffers are complete before any read
    payload = {"buckets": sender.buckets, "weight_version": version,
               "flush_cache": servers.config.flush_cache}
    servers.pause()
    try:
        for url in servers.urls:
            answer = call(url, "/update_weights_from_ipc", payload,
                          timeout=servers.config.timeout_s)
            check_commit(url, answer, version, combine_checksums(sender.checksums))
    finally:
        servers.resume(strict=False)
