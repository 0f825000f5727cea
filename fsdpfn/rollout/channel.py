"""The server's end of fsdpfn's update channel: a TCP connection per trainer, bound to a
weights-update group, carrying whole updates into the server's Receiver.

A connection first attaches to a group (the receiver closes it when it drops that group), then
carries whole updates. The layout is checked before any byte is sent (the server answers
"accepted" first); every bucket's receive is posted at once, each bucket checked on the device as
it lands (zero padding, per-tensor checksums, finite); the checks are read once and the server
answers "ready" with the version and the weights checksum; the weights are swapped in only when
the trainer, having compared that checksum with what it sent, answers "commit" (any other answer,
a closed connection or the group's timeout: previous weights kept). Frames: fsdpfn.wire.frames;
the trainer's end: fsdpfn.weights.channel.

This module owns the listening socket and one thread per connection; the update state (groups,
the turn, the swap) stays the Receiver's, reached through its public methods.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

from fsdpfn.rollout.errors import UpdateError
from fsdpfn.rollout.receiver import Receiver
from fsdpfn.rollout.staging import Layout
from fsdpfn.wire.frames import recv_frame, send_frame

__all__ = ["UpdateChannel"]


class UpdateChannel:
    """Listen on ``host``:``port`` (0: a free port; see ``.port``) for trainers' update channels
    (frames: fsdpfn.wire.frames) and serve them from ``receiver``, which then advertises the
    port in the model info. A connection first attaches to a group (it is closed when the
    server drops that group), then carries whole updates, the layout parsed once per connection
    and layout id, "accepted" sent before any byte is broadcast."""

    def __init__(self, receiver: Receiver, host: str = "127.0.0.1", port: int = 0):
        self.receiver = receiver
        self._listener = socket.create_server((host, int(port)), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        receiver.channel_port = self.port
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fsdpfn-update-channel").start()

    def close(self) -> None:
        self._closed = True
        self.receiver.channel_port = None
        try:
            self._listener.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="fsdpfn-update-channel-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        layouts: dict = {}
        state = {"group": None}  # the group this connection is attached to
        try:
            while True:
                try:
                    message = recv_frame(conn)
                except (OSError, ValueError):
                    return  # the trainer went away (or broke the protocol)
                try:
                    answer = self._handle(conn, message, state, layouts)
                except UpdateError as exc:
                    answer = {"success": False, "message": str(exc), "status": exc.status}
                except OSError:
                    return
                except Exception as exc:  # noqa: BLE001 - report, keep serving
                    answer = {"success": False, "status": 500,
                              "message": f"{type(exc).__name__}: {exc}"}
                try:
                    send_frame(conn, answer)
                except OSError:
                    return  # the trainer went away meanwhile (it gave the update up)
        finally:
            self.receiver.detach_channel(conn)
            conn.close()

    def _handle(self, conn, message: dict, state: dict, layouts: dict) -> dict:
        op, group = message.get("op"), state["group"]
        if op == "attach":
            self.receiver.attach_channel(str(message.get("group_name")), conn)
            state["group"] = str(message.get("group_name"))
            return {"success": True, "server_id": self.receiver.engine.server_id}
        if op != "update":
            raise UpdateError(f"op: must be 'attach' or 'update', got {op!r}")
        if group is None or message.get("group_name") != group:
            raise UpdateError(f"group_name: must be the group this channel is attached to, got "
                              f"{message.get('group_name')!r}", 409)
        key = message.get("layout_id")
        if message.get("buckets") is not None:
            engine = self.receiver.engine
            layouts[key] = Layout(engine.params, engine.aliases, message["buckets"])
        if key not in layouts:
            raise UpdateError(f"layout_id: must name a layout sent earlier on this connection "
                              f"(with its buckets), got {key!r}")
        return self.receiver.update(message, layouts[key], ack=lambda: send_frame(
            conn, {"success": True, "accepted": True}),
            decide=lambda ready, timeout_s: _await_commit(conn, ready, timeout_s),
            abandoned=lambda: _readable(conn))


def _readable(conn: socket.socket) -> bool:
    """Whether the trainer's end of a channel sent something, or closed it, while this server
    awaits an update's bytes: the trainer sends nothing then unless it gave the update up
    (it closes its channels when a push fails elsewhere, on another server or on its ranks)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def _await_commit(conn: socket.socket, ready: dict, timeout_s: float) -> bool:
    """Answer "ready" (the version and checksum of what arrived), then wait for the trainer's
    decision: True only for {"op": "commit"}; an abort, a closed connection or no answer within
    ``timeout_s`` is False."""
    try:
        send_frame(conn, {"success": True, "ready": True, **ready})
        conn.settimeout(timeout_s)
        decision = recv_frame(conn)
    except (OSError, ValueError):
        return False
    finally:
        with contextlib.suppress(OSError):
            conn.settimeout(None)
    return decision.get("op") == "commit"
