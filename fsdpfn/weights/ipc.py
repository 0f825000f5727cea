"""transport="ipc" of a RolloutTarget (servers on trainer rank 0's own GPU, where NCCL cannot
connect the two processes): rank 0 packs each gathered bucket into a device buffer and sends the
servers their CUDA IPC handles in one /update_weights_from_ipc request; each server copies the
tensors out on the device, checks and commits as for a whole update, and the buffers are freed
after its answer. The handle format lives in fsdpfn.wire.ipc."""

from __future__ import annotations

import torch

from fsdpfn.agree import is_rank_zero
from fsdpfn.errors import ConfigError
from fsdpfn.state import EngineState
from fsdpfn.weights.channel import check_commit
from fsdpfn.weights.gather import Bucket, send
from fsdpfn.wire.http import call
from fsdpfn.wire.ipc import share
from fsdpfn.wire.protocol import combine_checksums, dtype_name, tensor_checksums

__all__ = ["IpcSender", "push_ipc"]


class IpcSender:
    """Rank 0's side of an IPC push (a fsdpfn.weights.gather.Sender): each gathered bucket
    packed back to back into a device buffer of its own (kept alive until the servers
    answered), its handle and per-tensor checksums recorded; ``conclude`` sends every handle in
    one /update_weights_from_ipc request per server, generation paused around it."""

    flat = False
    start_before_finish = True

    def __init__(self, servers, version: int):
        self.servers = servers
        self.version = version
        self.buffers: list[torch.Tensor] = []
        self.buckets: list[dict] = []
        self.checksums: dict[str, int] = {}

    def start(self, bucket: Bucket, tensors: list[torch.Tensor]):
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

    def conclude(self) -> None:
        torch.cuda.current_stream().synchronize()  # the buffers are complete before any read
        servers = self.servers
        payload = {"buckets": self.buckets, "weight_version": self.version,
                   "flush_cache": servers.config.flush_cache}
        servers.pause()
        try:
            for url in servers.urls:
                answer = call(url, "/update_weights_from_ipc", payload,
                              timeout=servers.config.timeout_s)
                check_commit(url, answer, self.version, combine_checksums(self.checksums))
        finally:
            servers.resume(strict=False)
            self.buffers.clear()

    def abandon(self) -> None:
        self.buffers.clear()


def push_ipc(state: EngineState, params, buckets: list[Bucket], servers) -> tuple[int, int]:
    """Collective: every rank gathers; rank 0 packs each bucket into a device buffer of its own
    and hands the servers (on rank 0's GPU) their IPC handles; the buffers are freed once every
    server answered."""
    if state.mesh.device_type != "cuda":
        raise ConfigError(f"transport: 'ipc' shares CUDA memory and this trainer runs on "
                          f"{state.mesh.device_type}; use 'broadcast' or 'disk', got 'ipc'")
    sender = IpcSender(servers, state.version) if is_rank_zero() else None
    return send(state, params, buckets, sender, out_device=state.mesh.device)
