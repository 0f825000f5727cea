"""The weights-update group of a RolloutTarget (trainer rank 0 only): a process group that trainer
rank 0 and the servers form as SGLang's init_custom_process_group forms it
(fsdpfn.wire.protocol.make_group: a TCPStore hosted by rank 0, SGLang's prefixes; NCCL when
trainer and servers are on CUDA, else gloo), built once and reused across pushes, retired after a
failure. Every server joins with /init_weights_update_group; an SGLang server as one member per
tensor-parallel rank, under a name it has never seen (SGLang keeps a dropped group's name).
"""

from __future__ import annotations

import datetime
import socket
import time
import urllib.parse
from typing import Any, Sequence

import torch

from fsdpfn.errors import WeightSyncError
from fsdpfn.wire.ports import free_port
from fsdpfn.weights.push_config import PushConfig
from fsdpfn.weights.sglang import server_ranks
from fsdpfn.wire.http import Call, call
from fsdpfn.wire.protocol import make_group

__all__ = ["UpdateGroup"]

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class UpdateGroup:
    """Rank 0's end of the update group shared with the servers at ``urls``.

    ``live`` is the group in use, ``(store, pg, backend)`` or None; ``retired`` keeps the groups
    left after a failure referenced (destroying a group with an operation in flight blocks until
    its timeout); ``wire_name`` is the name the servers know the live group by."""

    def __init__(self, urls: Sequence[str], config: PushConfig):
        self.urls = list(urls)
        self.config = config
        self.live: tuple[Any, Any, str] | None = None
        self.retired: list = []
        self.wire_name = config.group_name
        self._builds = 0  # groups built for SGLang servers (each under a name of its own)

    def address(self) -> str:
        """Where the servers reach rank 0's store."""
        if self.config.master_address:
            return self.config.master_address
        hosts = [urllib.parse.urlparse(u).hostname or "" for u in self.urls]
        if all(h in _LOOPBACK for h in hosts):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((hosts[0], 9))  # a UDP connect sends nothing: it only picks the route
            return s.getsockname()[0]

    def _members(self, sglang: bool) -> list[int]:
        """How many members each server adds; picks the name the new group goes by."""
        if sglang:
            self._builds += 1  # SGLang keeps a dropped group's name: never reuse one
            self.wire_name = self.config.group_name if self._builds == 1 else \
                f"{self.config.group_name}.{self._builds}"
            return [server_ranks(url, self.config.timeout_s) for url in self.urls]
        self.wire_name = self.config.group_name
        return [1] * len(self.urls)

    def build(self, backend: str, device: torch.device, *, sglang: bool) -> None:
        """Form a new group with every server (the caller retired the old one first)."""
        cfg = self.config
        address = self.address()
        port = cfg.master_port or free_port(address)
        sizes = self._members(sglang)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        deadline = time.monotonic() + cfg.init_timeout_s
        bodies = {url: {"master_address": address, "master_port": port, "rank_offset": offset,
                        "world_size": world, "group_name": self.wire_name, "backend": backend}
                  for url, offset in zip(self.urls, offsets)}
        if not sglang:
            for body in bodies.values():
                body["timeout_s"] = cfg.timeout_s
        calls = [Call(lambda url=url: call(url, "/init_weights_update_group", bodies[url],
                                           timeout=cfg.init_timeout_s),
                      f"server {url}: /init_weights_update_group")
                 for url in self.urls]
        try:
            group = make_group(master_address=address, master_port=port, rank=0,
                               world_size=world, group_name=self.wire_name, backend=backend,
                               timeout_s=cfg.init_timeout_s, device=device)
        except Exception as exc:  # noqa: BLE001 - the servers' answers say more: prefer them
            for c in calls:
                c.result(min(deadline, time.monotonic() + 5.0))
            raise WeightSyncError(f"init_weights_update_group: building group "
                                  f"{cfg.group_name!r} ({backend}, {address}:{port}, "
                                  f"{world} members) failed: {type(exc).__name__}: {exc}") from None
        for c in calls:
            c.result(deadline)
        pg = group[1]
        if backend == "gloo" and hasattr(pg, "set_timeout"):
            pg.set_timeout(datetime.timedelta(seconds=cfg.timeout_s))
        self.live = (*group, backend)

    def retire(self) -> None:
        """Stop using the live group (an NCCL one is aborted); the next push builds a new one."""
        if self.live is None:
            return
        group, self.live = self.live, None
        if group[2] == "nccl":
            try:
                group[1].abort()
            except Exception:  # noqa: BLE001 - best effort on a broken communicator
                pass
        self.retired.append(group)

    def destroy_on_servers(self) -> None:
        """Ask every server to drop the live group (best effort)."""
        if self.live is None:
            return
        for url in self.urls:
            try:
                call(url, "/destroy_weights_update_group", {"group_name": self.wire_name},
                     timeout=min(self.config.timeout_s, 10.0))
            except WeightSyncError:
                pass
