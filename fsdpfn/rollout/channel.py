"""The server's end of the update channel (protocol: fsdpfn/wire/frames.py).

A listening socket beside the HTTP port; each connection gets a thread. A connection first
attaches to a weights-update group (it is closed when the server drops that group), then carries
whole updates: the engine does the same work as for ``/update_weights_from_distributed`` with
``buckets``, minus the web stack, with the layout parsed once per connection and layout id, and
an acceptance sent before any byte is broadcast.
"""

from __future__ import annotations

import socket
import threading

from fsdpfn.rollout.engine import RolloutEngine
from fsdpfn.rollout.errors import UpdateError
from fsdpfn.rollout.staging import Layout
from fsdpfn.wire.frames import recv_frame, send_frame

__all__ = ["UpdateChannel"]


class UpdateChannel:
    """Listen on ``host``:``port`` (0: a free port; see ``.port``) for trainers' update channels
    and serve them from ``engine`` (which then advertises the port in its model info)."""

    def __init__(self, engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self._listener = socket.create_server((host, int(port)), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        engine.channel_port = self.port
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fsdpfn-update-channel").start()

    def close(self) -> None:
        self._closed = True
        self.engine.channel_port = None
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
        layouts: dict[int, Layout] = {}
        group = None  # the group this connection is attached to (it closes with the group)
        try:
            while True:
                try:
                    message = recv_frame(conn)
                except (OSError, ValueError):
                    return  # the trainer went away (or broke the protocol): drop the connection
                op = message.get("op")
                try:
                    if op == "attach":
                        self.engine.attach_channel(str(message.get("group_name")), conn)
                        group = str(message.get("group_name"))
                        send_frame(conn, {"success": True, "server_id": self.engine.server_id})
                    elif op == "update":
                        answer = self._update(conn, group, message, layouts)
                        send_frame(conn, answer)
                    else:
                        raise UpdateError(f"op: must be 'attach' or 'update', got {op!r}")
                except UpdateError as exc:
                    send_frame(conn, {"success": False, "message": str(exc),
                                      "status": exc.status})
                except OSError:
                    return
                except Exception as exc:  # noqa: BLE001 - report, keep serving
                    send_frame(conn, {"success": False, "status": 500,
                                      "message": f"{type(exc).__name__}: {exc}"})
        finally:
            self.engine.detach_channel(conn)
            conn.close()

    def _update(self, conn: socket.socket, group: str | None, message: dict,
                layouts: dict[int, Layout]) -> dict:
        if group is None or message.get("group_name") != group:
            raise UpdateError(f"group_name: must be the group this channel is attached to, got "
                              f"{message.get('group_name')!r}", 409)
        key = message.get("layout_id")
        if message.get("buckets") is not None:
            layouts[key] = Layout(self.engine, message["buckets"])
        layout = layouts.get(key)
        if layout is None:
            raise UpdateError(f"layout_id: must name a layout sent earlier on this connection "
                              f"(with its buckets), got {key!r}")
        return self.engine.update_from_distributed(
            message, layout=layout,
            ack=lambda: send_frame(conn, {"success": True, "accepted": True}))
