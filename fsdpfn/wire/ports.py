"""Free TCP ports: the one helper that every process group, test harness and server launch uses."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on at ``address`` now (the OS picks it; it may be taken
    again before the caller binds it, which callers tolerate by retrying or failing loudly)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
