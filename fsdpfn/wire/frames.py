"""Frames of the update channel, spoken by both ends (fsdpfn.weights.channel on the trainer,
fsdpfn.rollout.receiver on the server).

Why: a push of a few GB over NVLink takes milliseconds, and an HTTP request through the server's
web stack costs about as much as a millisecond or more each way. Over the channel a push costs
no HTTP request at all: one message out (the update, its bucket layout sent once per
connection and then named by id), an acceptance back before any byte is broadcast, and the
answer after the commit.

Frames: 4-byte big-endian length, then a UTF-8 JSON object. Trainer -> server:

    {"op": "attach", "group_name": g}                       -> {"success", "server_id"}
    {"op": "update", "layout_id": k, "buckets": [...]?,     -> {"accepted": true} or a failure,
     "group_name", "weight_version"}                           then (when accepted) {"success",
                                                               "weight_version",
                                                               "weights_checksum", "seconds"}

``buckets`` ({names, dtypes, shapes} per bucket) comes with the first update that uses a layout id
on a connection; later updates name it only. A failure is {"success": false, "message", "status"}.
The server closes the connection when it drops the group (so the trainer knows, for free, that it
must set up again), and a dead server closes it too (the OS does): the trainer notices without
waiting for a timeout.
"""

from __future__ import annotations

import json
import socket
import struct

__all__ = ["send_frame", "recv_frame", "MAX_FRAME"]

MAX_FRAME = 64 << 20  # a layout of many thousand tensors is well under this
_HEADER = struct.Struct(">I")


def send_frame(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the connection was closed by the other end")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict:
    """One message (blocking, within the socket's timeout); ConnectionError on EOF, ValueError on
    a malformed frame."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > MAX_FRAME:
        raise ValueError(f"frame length must be <= {MAX_FRAME} bytes, got {length}")
    message = json.loads(_recv_exact(sock, length))
    if not isinstance(message, dict):
        raise ValueError(f"a frame must hold a JSON object, got {type(message).__name__}")
    return message
