"""CUDA IPC handles as plain JSON (both ends of an IPC push speak them): the weight push between
two processes on one GPU.

NCCL cannot connect two processes on the same device, and a round trip through disk writes and
reads every byte of the weights through the file system on each push (BENCHMARKS.md, "Push by
disk against CUDA IPC"). Instead trainer rank 0 hands the server an IPC handle to each gathered
bucket (one device buffer); the server maps the same memory, copies it on the device, and
answers; then the trainer frees the buffer. What crosses the wire is a handle (torch's CUDA IPC
fields, base64 for bytes), never a pickle, so a request cannot run code in the server.

    handle = share(buffer)             # trainer: JSON-able dict; keep ``buffer`` alive until the
    buffer = open_shared(handle, dev)  #   server answered; server: the same memory, uint8 [n]
"""

from __future__ import annotations

import base64

import torch

__all__ = ["share", "open_shared", "device_uuid"]


def _b64(value) -> str | None:
    return None if value is None else base64.b64encode(bytes(value)).decode("ascii")


def _bytes(value) -> bytes | None:
    return None if value is None else base64.b64decode(value)


def device_uuid(device: torch.device) -> str:
    """The physical GPU's UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def share(buffer: torch.Tensor) -> dict:
    """The IPC handle of a contiguous uint8 CUDA ``buffer`` as JSON-able fields."""
    from torch.multiprocessing.reductions import reduce_tensor

    assert buffer.is_cuda and buffer.dtype == torch.uint8 and buffer.dim() == 1
    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return {"numel": int(size[0]), "stride": int(stride[0]), "offset": int(offset),
            "handle": _b64(handle), "storage_bytes": int(storage_bytes),
            "storage_offset": int(storage_offset), "ref_handle": _b64(ref_handle),
            "ref_offset": int(ref_offset), "event_handle": _b64(event_handle),
            "event_sync": bool(event_sync), "device_uuid": device_uuid(buffer.device)}


def open_shared(fields: dict, device: torch.device) -> torch.Tensor:
    """The uint8 buffer behind ``fields`` (from share), mapped on ``device``; ValueError when
    the handle is malformed or belongs to another GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        uuid = str(fields["device_uuid"])
        numel, stride, offset = int(fields["numel"]), int(fields["stride"]), int(fields["offset"])
        args = (_bytes(fields["handle"]), int(fields["storage_bytes"]),
                int(fields["storage_offset"]), False, _bytes(fields["ref_handle"]),
                int(fields["ref_offset"]), _bytes(fields.get("event_handle")),
                bool(fields.get("event_sync", True)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"handle: malformed IPC handle ({type(exc).__name__}: {exc})") from None
    if uuid != device_uuid(device):
        raise ValueError(f"handle: the buffer lives on GPU {uuid}, and this server runs on "
                         f"{device_uuid(device)}; IPC pushes need trainer rank 0 and the server "
                         f"on one GPU")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([numel]), (stride,), offset,
                               torch.storage.TypedStorage, torch.uint8, device.index, *args)
