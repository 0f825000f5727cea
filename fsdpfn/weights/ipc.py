"""Trainer rank 0's sender of an IPC push; the handle format lives in fsdpfn.wire.ipc."""

from __future__ import annotations

import torch

from fsdpfn.wire.ipc import device_uuid, open_shared, share, unpack
from fsdpfn.wire.protocol import dtype_name, tensor_checksums

__all__ = ["share", "open_shared", "device_uuid", "IpcSender", "unpack"]


class IpcSender:
    """Rank 0's side of gather_and_send() for an IPC push: each gathered bucket packed back to
    back into a device buffer of its own (kept alive until release()), its handle and per-tensor checksums
    recorded. ``update`` is the request body for /update_weights_from_ipc (without the
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
