"""The update channel, trainer side: the push to fsdpfn.rollout servers.

A persistent TCP connection from trainer rank 0 to each server (``Channel``), bound to one
weights-update group, carries a push's control messages (frames: fsdpfn.wire.frames); the bytes
go by one broadcast per bucket over the group (NCCL between GPUs, else gloo).

``ChannelSender`` (a fsdpfn.weights.gather.Sender): the update message goes out before the first
bucket is gathered (its bucket layout only the first time a server sees that layout, then its
id); each server checks it and answers "accepted" before any byte is broadcast, so a refused
update never leaves a server waiting for bytes; the broadcasts follow without waiting for each
other (gather_and_send's memory bound); each server, once every byte arrived and was checked,
answers "ready" with the version and the checksum of what it received, which must equal the
checksum of what was sent; only then does rank 0 send "commit" to every server, which swaps the
weights in and answers a last time. A failure before the commit (on the trainer after the last
byte, a checksum that differs) leaves every server on its previous weights: the channel is
closed and the server, waiting for the decision, keeps them. While waiting on the wire the
channels are watched: a server's failure or exit is seen at once, not at the timeout.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Callable

import torch

from fsdpfn.errors import WeightSyncError
from fsdpfn.weights.gather import Bucket
from fsdpfn.wire.frames import recv_frame, send_frame
from fsdpfn.wire.protocol import broadcast, combine_on_device, flat_checksums

__all__ = ["Channel", "ChannelSender", "wait_readable", "check_commit"]


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


class ChannelSender:
    """Rank 0's side of a push over update channels (see the module doc). ``servers``: a
    fsdpfn.weights.servers.Servers with a channel open to every server."""

    flat = True
    start_before_finish = True

    def __init__(self, servers, buckets: list[Bucket], version: int, layout_id: int, *,
                 merged_adapters: bool = False):
        self.servers = servers
        self.merged_adapters = merged_adapters
        self.buckets = buckets
        self.version = version
        self.checksums = SentChecksums()
        self.channels = {url: servers.channels[url] for url in servers.urls}
        self.answers: dict[str, dict] = {}
        self.accepted = False
        self._send_update(layout_id)

    def _send_update(self, layout_id: int) -> None:
        message = {"op": "update", "layout_id": layout_id,
                   "group_name": self.servers.config.group_name,
                   "weight_version": self.version, "merged_adapters": self.merged_adapters}
        metadata = None
        for ch in self.channels.values():
            if layout_id not in ch.layouts:
                metadata = metadata or [b.metadata for b in self.buckets]
                ch.send({**message, "buckets": metadata})
                ch.layouts.add(layout_id)
            else:
                ch.send(message)

    def _await_accepted(self) -> None:
        deadline = time.monotonic() + self.servers.config.timeout_s
        for url, ch in self.channels.items():
            answer = ch.read(deadline, "the update")
            if not answer.get("accepted"):
                raise WeightSyncError(f"server {url}: the update channel must answer "
                                      f"'accepted' first, got {str(answer)[:200]}")
        self.accepted = True

    def start(self, bucket: Bucket, flat: torch.Tensor):
        cfg = self.servers.config
        if not self.accepted:
            self._await_accepted()
        work = broadcast(self.servers.group.live[1], flat[:bucket.nbytes])
        self.checksums.add(bucket, flat)  # queued when the next bucket is out
        if cfg.on_bucket is not None:
            cfg.on_bucket(bucket.index, len(self.buckets))
        return bucket, work, time.monotonic() + cfg.timeout_s

    def _watch(self, wait_s: float) -> None:
        """Read whatever a server sent meanwhile (its final answer, or its failure: raised)."""
        waiting = [ch.sock for url, ch in self.channels.items() if url not in self.answers]
        if not waiting:
            time.sleep(wait_s)
            return
        ready = wait_readable(waiting, wait_s)
        for url, ch in self.channels.items():
            if ch.sock in ready:
                self.answers[url] = ch.read(time.monotonic() + self.servers.config.timeout_s,
                                            "the update")

    def finish(self, handle) -> None:
        bucket, work, deadline = handle
        self.checksums.flush()  # the buffer may be released once this returns
        where = (f"[bucket {bucket.index} of {len(self.buckets)}, {len(bucket.specs)} tensors "
                 f"from {bucket.names[0]!r}, {bucket.nbytes} bytes; "
                 f"timeout_s={self.servers.config.timeout_s:g}]")
        await_wire(work, deadline, self.servers.urls, where, self._watch)

    def conclude(self) -> None:
        """Every server's "ready" checked against what was sent, then "commit" to each and its
        final answer read (two phases: a failure before the commit leaves no server changed)."""
        checksum = self.checksums.value()
        deadline = time.monotonic() + self.servers.config.timeout_s
        for url, ch in self.channels.items():
            if url not in self.answers:
                self.answers[url] = ch.read(deadline, "the update")
        for url, answer in self.answers.items():
            if not answer.get("ready"):
                raise WeightSyncError(f"server {url}: the update channel must answer 'ready' "
                                      f"once the bytes arrived, got {str(answer)[:200]}")
            check_commit(url, answer, self.version, checksum)
        for ch in self.channels.values():
            ch.send({"op": "commit"})
        deadline = time.monotonic() + self.servers.config.timeout_s
        final = {url: ch.read(deadline, "the commit") for url, ch in self.channels.items()}
        for url, answer in final.items():
            check_commit(url, answer, self.version, checksum)
        self.servers.last_apply_s = sum(float((a.get("seconds") or {}).get("apply", 0.0))
                                        for a in final.values())

    def abandon(self) -> None:
        self.servers.retire()


def await_wire(work, deadline: float, urls, where: str, watch: Callable[[float], None]) -> None:
    """Wait for a bucket's broadcast, calling watch(seconds) between polls (it raises
    WeightSyncError when a server failed meanwhile); every failure is a WeightSyncError naming
    the bucket (``where``)."""
    try:
        while not work.is_completed():
            watch(0.0002)
            if time.monotonic() > deadline:
                raise WeightSyncError(f"broadcast to {urls} did not complete within timeout_s")
        work.wait()
    except WeightSyncError as exc:
        raise WeightSyncError(f"{exc} {where}") from None
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError
        raise WeightSyncError(f"broadcast to {urls} failed: {type(exc).__name__}: {exc} "
                              f"{where}") from None


class SentChecksums:
    """The checksums of the buckets sent, queued on the device one bucket late: a bucket's are
    queued once the next bucket has gone out (or at a finish, or at the end), so the host
    launches the next bucket's gather before paying the checksum's few dozen kernel launches
    (the wire idle meanwhile). The late bucket's buffer is held until then; its kernels read
    it in stream order, after the next gather. Read once, at the end: no synchronisation per
    bucket."""

    def __init__(self):
        self._queued: list[tuple[list[str], torch.Tensor]] = []
        self._late: tuple[Bucket, torch.Tensor] | None = None

    def add(self, bucket: Bucket, flat: torch.Tensor) -> None:
        self.flush()
        self._late = (bucket, flat)

    def flush(self) -> None:
        if self._late is not None:
            bucket, flat = self._late
            self._queued.append((bucket.names, flat_checksums(flat, bucket.offsets,
                                                              bucket.sizes)))
            self._late = None

    def value(self) -> int:
        """The weights checksum of every bucket added (one synchronisation)."""
        self.flush()
        names = [n for batch, _ in self._queued for n in batch]
        return int(combine_on_device(torch.cat([v for _, v in self._queued]), names))


def check_commit(url: str, answer: dict, version: int, checksum: int) -> None:
    """A server's answer after an update must carry the pushed version and the checksum of what
    was sent."""
    if answer.get("weight_version") != version:
        raise WeightSyncError(f"server {url}: weight_version after the update must be {version}, "
                              f"got {answer.get('weight_version')!r}")
    if answer.get("weights_checksum") != checksum:
        raise WeightSyncError(f"server {url}: weights_checksum after the update must equal the "
                              f"checksum of the pushed weights {checksum}, got "
                              f"{answer.get('weights_checksum')!r} (the server does not hold "
                              f"what was sent)")
