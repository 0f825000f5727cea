"""The update channel, trainer side: a persistent TCP connection from trainer rank 0 to an
fsdpfn.rollout server, bound to one weights-update group, carrying a push's control messages
instead of HTTP. Why, and the frames both ends speak: fsdpfn.wire.frames."""

from __future__ import annotations

import select
import socket
import time

from fsdpfn.errors import WeightSyncError
from fsdpfn.wire.frames import MAX_FRAME, recv_frame, send_frame

__all__ = ["send_frame", "recv_frame", "Channel", "MAX_FRAME", "wait_readable"]


def wait_readable(socks: list, wait_s: float) -> list:
    """The sockets among ``socks`` with something to read within ``wait_s`` seconds. poll, not
    select: select refuses file descriptors above 1023, which a long-lived trainer process
    (many groups, stores and connections) reaches."""
    poller = select.poll()
    by_fd = {}
    for sock in socks:
        poller.register(sock, select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR)
        by_fd[sock.fileno()] = sock
    return [by_fd[fd] for fd, _ in poller.poll(max(0.0, wait_s) * 1000.0)]


class Channel:
    """Trainer rank 0's end of one server's update channel (see the module doc)."""

    def __init__(self, url: str, host: str, port: int, group_name: str, timeout_s: float):
        self.url = url
        self.where = f"server {url}: update channel {host}:{port}"
        self.layouts: set[int] = set()  # layout ids this server has been sent
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as exc:
            error = WeightSyncError(f"{self.where}: connecting failed: {type(exc).__name__}: "
                                    f"{exc}")
            error.unreachable = True  # not a refusal by the server: its port cannot be reached
            raise error from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.send({"op": "attach", "group_name": group_name})
        answer = self.read(time.monotonic() + timeout_s, "attach")
        self.server_id = answer.get("server_id")

    def send(self, message: dict) -> None:
        try:
            send_frame(self.sock, message)
        except OSError as exc:
            raise WeightSyncError(f"{self.where}: sending failed: {type(exc).__name__}: {exc} "
                                  f"(is the server running?)") from None

    def readable(self, wait_s: float = 0.0) -> bool:
        """Whether a message (or the end of the connection) is waiting."""
        return bool(wait_readable([self.sock], wait_s))

    def stale(self) -> bool:
        """True when the connection has something unasked for waiting: the server closed it (it
        dropped the group, or exited) or broke the protocol. Costs one select."""
        try:
            return self.readable(0.0)
        except (OSError, ValueError):
            return True

    def read(self, deadline: float, what: str) -> dict:
        """The next message by ``deadline``; WeightSyncError on a timeout, a closed connection, or
        an answer with success false (its message and status)."""
        try:
            if not self.readable(deadline - time.monotonic()):
                raise WeightSyncError(f"{self.where}: no answer to {what} before the deadline "
                                      f"(timeout_s)")
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            answer = recv_frame(self.sock)
        except (OSError, ValueError) as exc:
            raise WeightSyncError(f"{self.where}: {what} failed: {type(exc).__name__}: {exc} "
                                  f"(did the server exit?)") from None
        if answer.get("success") is False:
            raise WeightSyncError(f"server {self.url}: {what} over the update channel answered "
                                  f"{answer.get('status', 500)}: {answer.get('message')}")
        return answer

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
