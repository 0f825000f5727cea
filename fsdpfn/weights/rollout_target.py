"""RolloutTarget: push to one or more rollout servers (fsdpfn.rollout, or stock SGLang servers:
see fsdpfn.weights.sglang for SGLang's protocol, chosen when a server's /get_model_info lists
neither ``params`` nor ``update_channel``; what follows describes fsdpfn.rollout servers).

transport="broadcast" (default). Trainer rank 0 and the servers share a dedicated process group
(NCCL when trainer and servers are on CUDA, else gloo), built once from a TCPStore hosted by rank 0
and reused across pushes (rebuilt when a server no longer lists it, or after a failure). Per push:

  1. rank 0 checks the servers. With an update channel open to every server (below) and a
     layout seen before, this costs nothing: an open channel shows the server is up and still
     holds the group. Otherwise rank 0 reads /health (and /get_model_info after a server
     restart or a layout change): the push dtype (the served dtype unless ``dtype`` is given),
     and, with ``precheck``, names and shapes against the trainer's; it (re)builds the group
     when needed and opens the update channels. Rank 0's verdict reaches every rank before any
     gather.
  2. buckets are gathered by all ranks in a fixed order: ``bucket_bytes`` (default 1 GiB) in
     the middle, ``edge_bucket_bytes`` (default 256 MiB) at both ends, so the wire starts
     after a small gather and the server's checks of the last bucket are short. Buckets go out
     while the next ones are gathered, up to twice the largest bucket in flight.
     - fsdpfn.rollout servers offer an update channel (``update_channel`` in their model info;
       fsdpfn.weights.channel): a TCP connection per server, bound to the group. Rank 0 sends
       the update (the bucket layout the first time, then its id) before the first gather;
       each server answers "accepted" before any byte is broadcast, posts every receive, checks
       each bucket as it lands, commits, and answers with its weights checksum.
       ``channel=False`` sends the same update as one HTTP request instead.
     - Otherwise (``one_request=False``), for each bucket rank 0 posts the
       metadata {names, dtypes, shapes, group_name, flush_cache,
       load_format="flattened_bucket", weight_version, update_id, bucket_index, commit} to
       /update_weights_from_distributed in a thread (the call blocks in the server while it
       receives) and broadcasts one flat uint8 buffer asynchronously; the last bucket carries
       commit=true, and with ``pause_generation`` rank 0 pauses generation around it.
     The dtypes advertised are those of the bytes sent (the layout is in
     fsdpfn.weights.protocol).
  3. every server's answer must carry the pushed version and a weights_checksum equal to the
     checksum of what was sent.

transport="ipc" (a server on trainer rank 0's own GPU, where NCCL cannot connect the two
processes): rank 0 packs each gathered bucket into a device buffer and sends the servers its CUDA
IPC handle in one /update_weights_from_ipc request; each server copies the tensors out on the
device, checks and commits as for a whole update, and the buffers are freed after its answer.

transport="disk": the ranks write ``disk_root/v{version}`` (a DiskTarget layout, which the
servers must be able to read at the same path), then rank 0 calls /update_weights_from_disk.

Every request and every bucket's transfer is bounded by ``timeout_s`` (group set-up by
``init_timeout_s``). Any failure raises WeightSyncError on every trainer rank naming the server,
the endpoint or tensor, the rule and the value. Each server swaps atomically, so a failed push
leaves it serving its previous weights; with several servers, those that committed before the
failure keep the new version (the message says which failed).
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.agree import (agree_on_error, capture_error, is_rank_zero,
                          share_from_rank_zero)
from fsdpfn.ports import free_port
from fsdpfn.state import EngineState
from fsdpfn.weights.disk import rotate, write_version
from fsdpfn.weights.gather import Bucket, gather_and_send, plan_buckets, weights_and_layout
from fsdpfn.weights.channel import Channel, wait_readable
from fsdpfn.wire.http import Call, call
from fsdpfn.weights.sglang import is_sglang, make_sglang_group, server_ranks
from fsdpfn.wire.protocol import (DEFAULT_BUCKET_BYTES, DEFAULT_EDGE_BYTES, broadcast,
                                     combine_on_device,
                                     dtype_from_name, flat_checksums, make_group, wait_work)

__all__ = ["RolloutTarget"]

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PAUSE_MODES = ("abort", "retract", "in_place")


class RolloutTarget:
    """Push to rollout servers at ``urls`` (see the module doc for the protocol).

    transport: "broadcast", "disk" (needs ``disk_root``, shared with the servers) or "ipc"
    (servers on trainer rank 0's GPU: CUDA IPC handles to device buffers, see
    fsdpfn.weights.ipc).
    dtype: the dtype sent (None: the servers' served dtype).
    backend: "gloo" or "nccl" (None: nccl when the trainer and every server are on CUDA).
    timeout_s: bound on every HTTP request and every bucket's transfer; init_timeout_s on
    creating the group. pause_generation: pause around the swap. precheck: compare names and
    shapes with each server's before sending. master_address / master_port: where the servers
    reach trainer rank 0's store (None: 127.0.0.1 for local servers, else the address of the
    interface that routes to the first server; a free port). on_bucket(index, n_buckets): called
    on rank 0 once each bucket is on the wire (progress reports). bucket_bytes /
    edge_bucket_bytes: the size of the middle buckets and of the first and last ones (None: no
    ramp). channel: use the servers' update channels when every server offers one (else HTTP).
    one_request / pipeline: over HTTP, the whole update in one request (fsdpfn.rollout), or a
    request per bucket posted ahead (pipeline) or in turn. pause_mode: SGLang's
    /pause_generation mode ("abort", "retract", "in_place"). probe_tol: after a push to SGLang,
    the largest gap allowed between the server's greedy log-probs on a fixed prompt and the
    trainer's forward_logp (None: 1e-3 for a float32 push, 0.1 for 16-bit dtypes).
    """

    def __init__(self, urls: str | Sequence[str], *, transport: str = "broadcast",
                 dtype: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 backend: str | None = None, timeout_s: float = 300.0,
                 init_timeout_s: float = 120.0, pause_generation: bool = True,
                 flush_cache: bool = True, precheck: bool = True,
                 disk_root: str | os.PathLike | None = None, keep_last: int = 2,
                 master_address: str | None = None, master_port: int | None = None,
                 group_name: str | None = None,
                 on_bucket: Callable[[int, int], None] | None = None, pipeline: bool = True,
                 one_request: bool = True, channel: bool = True,
                 edge_bucket_bytes: int | None = DEFAULT_EDGE_BYTES,
                 pause_mode: str = "abort", probe_tol: float | None = None):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                               for u in urls):
            raise ConfigError(f"urls: must be one or more 'http://host:port' strings, got {urls!r}")
        if transport not in ("broadcast", "disk", "ipc"):
            raise ConfigError(f"transport: must be 'broadcast', 'disk' or 'ipc', got "
                              f"{transport!r}")
        if transport == "disk" and disk_root is None:
            raise ConfigError("disk_root: must be set for transport='disk' (a directory the "
                              "servers can read at the same path), got None")
        if backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"backend: must be None, 'gloo' or 'nccl', got {backend!r}")
        for key, value in (("timeout_s", timeout_s), ("init_timeout_s", init_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{key}: must be a number > 0, got {value!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes: must be an int >= 1, got {bucket_bytes!r}")
        if edge_bucket_bytes is not None and (not isinstance(edge_bucket_bytes, int)
                                              or edge_bucket_bytes < 1):
            raise ConfigError(f"edge_bucket_bytes: must be None or an int >= 1, got "
                              f"{edge_bucket_bytes!r}")
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last: must be an int >= 1, got {keep_last!r}")
        if pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode: must be one of {PAUSE_MODES} (SGLang's "
                              f"/pause_generation modes), got {pause_mode!r}")
        if probe_tol is not None and (not isinstance(probe_tol, (int, float))
                                      or isinstance(probe_tol, bool) or not probe_tol >= 0):
            raise ConfigError(f"probe_tol: must be None or a number >= 0, got {probe_tol!r}")
        if dtype is not None:
            try:
                dtype_from_name(dtype)
            except ValueError as exc:
                raise ConfigError(f"dtype: {exc}") from None
        self.urls = [u.rstrip("/") for u in urls]
        self.transport = transport
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.init_timeout_s = float(init_timeout_s)
        self.pause_generation = pause_generation
        self.flush_cache = flush_cache
        self.precheck = precheck
        self.disk_root = None if disk_root is None else Path(disk_root)
        self.keep_last = keep_last
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name or f"fsdpfn-{uuid.uuid4().hex[:8]}"
        self.on_bucket = on_bucket
        self.pipeline = bool(pipeline)
        self.one_request = bool(one_request)
        self.channel = bool(channel)
        self.edge_bucket_bytes = edge_bucket_bytes
        self.pause_mode = pause_mode
        self.probe_tol = probe_tol
        # rank 0 only: whether the servers speak SGLang's protocol (None: not asked yet), and the
        # name of the live group on the wire (SGLang cannot re-create a name: one per build)
        self._sglang: bool | None = None
        self._wire_group = self.group_name
        self._builds = 0
        # rank 0 only: the live group (store, pg, backend) and groups left after a failure
        # (kept referenced: destroying a group with an operation in flight blocks until its
        # timeout)
        self._group: tuple[Any, Any, str] | None = None
        self._retired: list = []
        self.last_timings: dict[str, float] = {}  # seconds per phase of the last push
        self.timeline = False  # benchmarks: record per-bucket GPU times into last_timeline
        self.last_timeline: dict | None = None
        # rank 0 only: url -> (server_id, trainer layout hash, /get_model_info answer)
        self._infos: dict[str, tuple[Any, int, dict]] = {}
        # rank 0 only: url -> its update channel (bound to the live group)
        self._channels: dict[str, Channel] = {}
        self._unreachable: set[tuple] = set()  # (url, server_id, port) whose channel failed
        self._prepared: tuple[str, str] | None = None  # (dtype, backend) of the last push
        self._plans: dict[tuple, tuple[int, list[Bucket]]] = {}  # (layout, dtype) -> (id, plan)

    def __repr__(self) -> str:
        return f"RolloutTarget({self.urls!r}, transport={self.transport!r})"

    # ------------------------------------------------------------ the collective push

    def push(self, state: EngineState) -> tuple[int, int]:
        """Collective over the trainer ranks; returns (n_tensors, n_bytes). Afterwards
        ``last_timings`` holds this rank's seconds per phase: prepare (server checks, group),
        transfer (gather + send + the servers' commit), conclude (checksums, continue)."""
        clock = self._clock = time.perf_counter()
        self.last_timings = {}
        params, layout = weights_and_layout(state)
        plan, error = (capture_error(lambda: self._prepare(state, params, layout), "preparing the push")
                       if is_rank_zero() else (None, None))
        dtype_str, backend, sglang = share_from_rank_zero(plan, error)
        dtype = dtype_from_name(dtype_str)
        self.last_timings["prepare"] = time.perf_counter() - clock
        if self.transport == "disk":
            return self._push_disk(state, dtype, sglang)
        if sglang:
            return self._push_sglang(state, params, layout, dtype, backend)
        if self.transport == "ipc":
            return self._push_ipc(state, params, layout, dtype)
        return self._push_broadcast(state, params, layout, dtype, backend)

    def _plan(self, params, layout: tuple, dtype: torch.dtype) -> tuple[int, list[Bucket]]:
        """(layout id, buckets), planned once per trainer layout and dtype."""
        key = (layout, dtype)
        if key not in self._plans:
            self._plans[key] = (len(self._plans), plan_buckets(
                params, dtype, self.bucket_bytes, self.edge_bucket_bytes))
        return self._plans[key]

    def _push_broadcast(self, state: EngineState, params, layout: tuple, dtype: torch.dtype,
                        backend: str) -> tuple[int, int]:
        layout_id, buckets = self._plan(params, layout, dtype)
        sender = None
        if is_rank_zero():
            if self._channels and all(url in self._channels for url in self.urls):
                sender = _ChannelSender(self, buckets, state.version, layout_id)
            elif self.one_request and self.pipeline and all(
                    self._infos[url][2].get("multi_bucket") for url in self.urls):
                sender = _OneRequestSender(self, buckets, state.version)
            else:
                sender = _BroadcastSender(self, buckets, state.version)
        return self._send_flat(state, params, buckets, sender, backend)

    def _send_flat(self, state: EngineState, params, buckets: list[Bucket], sender,
                   backend: str) -> tuple[int, int]:
        """Collective: every bucket gathered flat and handed to rank 0's ``sender`` (None on
        the other ranks), then its conclusion agreed on; abandoned on any failure."""
        out_device = state.mesh.device if backend == "nccl" else torch.device("cpu")
        try:
            clock = time.perf_counter()
            gather_and_send(state, dict(params), buckets, sender,
                            gather_device=state.mesh.device, out_device=out_device, flat=True)
            self.last_timings["transfer"] = time.perf_counter() - clock
            clock = time.perf_counter()
            error = None
            if sender is not None:
                _, error = capture_error(sender.conclude, "concluding the push")
            agree_on_error(state.mesh, error)
            self.last_timings["conclude"] = time.perf_counter() - clock
        except BaseException:
            if sender is not None:
                sender.abandon()
            raise
        return sum(len(b.specs) for b in buckets), sum(sum(b.sizes) for b in buckets)

    def _push_ipc(self, state: EngineState, params, layout: tuple,
                  dtype: torch.dtype) -> tuple[int, int]:
        """Rank 0 packs each gathered bucket into a device buffer of its own and hands the
        servers (on rank 0's GPU) their IPC handles in one /update_weights_from_ipc request;
        the buffers are freed once every server answered."""
        from fsdpfn.weights.ipc import IpcSender

        if state.mesh.device_type != "cuda":
            raise ConfigError(f"transport: 'ipc' shares CUDA memory and this trainer runs on "
                              f"{state.mesh.device_type}; use 'broadcast' or 'disk', got 'ipc'")
        _, buckets = self._plan(params, layout, dtype)
        sender = IpcSender() if is_rank_zero() else None
        try:
            clock = time.perf_counter()
            gather_and_send(state, dict(params), buckets, sender,
                            gather_device=state.mesh.device, out_device=state.mesh.device,
                            flat=False)
            error = None
            if sender is not None:
                _, error = capture_error(lambda: self._load_ipc(sender, state.version),
                                 "updating over CUDA IPC")
            agree_on_error(state.mesh, error)
            self.last_timings["transfer"] = time.perf_counter() - clock
        finally:
            if sender is not None:
                sender.release()
        return sum(len(b.specs) for b in buckets), sum(sum(b.sizes) for b in buckets)

    def _load_ipc(self, sender, version: int) -> None:
        from fsdpfn.wire.protocol import combine_checksums

        torch.cuda.current_stream().synchronize()  # the buffers are complete before any read
        payload = {"buckets": sender.buckets, "weight_version": version,
                   "flush_cache": self.flush_cache}
        self._pause()
        try:
            for url in self.urls:
                answer = call(url, "/update_weights_from_ipc", payload, timeout=self.timeout_s)
                _check_commit(url, answer, version, combine_checksums(sender.checksums))
        finally:
            self._continue(strict=False)

    def _push_disk(self, state: EngineState, dtype: torch.dtype,
                   sglang: bool) -> tuple[int, int]:
        final, n_tensors, n_bytes, checksum = write_version(
            state, self.disk_root, dtype=dtype, bucket_bytes=self.bucket_bytes)
        error = None
        if is_rank_zero():
            load = self._load_from_disk_sglang if sglang else self._load_from_disk
            _, error = capture_error(lambda: load(final, state.version, checksum), "loading from disk")
            if error is None:
                _, error = capture_error(lambda: rotate(self.disk_root, self.keep_last),
                                 "rotating old versions")
        agree_on_error(state.mesh, error)
        if sglang:
            self._probe(state, dtype)
        return n_tensors, n_bytes

    def _push_sglang(self, state: EngineState, params, layout: tuple, dtype: torch.dtype,
                     backend: str) -> tuple[int, int]:
        """SGLang's protocol (fsdpfn.weights.sglang): a request and a packed broadcast per
        bucket, one at a time, generation paused throughout; then its version and a probe."""
        from fsdpfn.weights.sglang import SGLangSender

        _, buckets = self._plan(params, layout, dtype)
        sender = SGLangSender(self, buckets, state.version) if is_rank_zero() else None
        sent = self._send_flat(state, params, buckets, sender, backend)
        self._probe(state, dtype)
        return sent

    def _probe(self, state: EngineState, dtype: torch.dtype) -> None:
        """Collective: each server's greedy log-probs on a fixed prompt against forward_logp."""
        from tensordict import TensorDict

        from fsdpfn.forward import forward_logp
        from fsdpfn.weights.sglang import compare_probe, probe_tokens, run_probes

        prompt = probe_tokens(state.hf_config.vocab_size)
        probes, error = (capture_error(lambda: run_probes(self.urls, prompt, self.timeout_s),
                               "probing the servers") if is_rank_zero() else (None, None))
        probes = share_from_rank_zero(probes, error)
        rows = [prompt + ids for ids, _ in probes]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = True
        batch = TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(rows)])
        logp = forward_logp(state, batch)["logp"]
        tol = self.probe_tol if self.probe_tol is not None else \
            (1e-3 if dtype == torch.float32 or dtype == torch.float64 else 0.1)
        error = None
        if is_rank_zero():
            _, error = capture_error(lambda: [compare_probe(url, prompt, out, served, logp[i], tol)
                                      for i, (url, (out, served)) in
                                      enumerate(zip(self.urls, probes))],
                             "comparing the probe")
        agree_on_error(state.mesh, error)

    # ------------------------------------------------------------ rank 0: preparation

    def _prepare(self, state: EngineState, params, layout: tuple) -> tuple[str, str, bool]:
        """(push dtype name, backend, whether the servers are SGLang's); checks names/shapes;
        (re)builds the group if needed.

        The servers' model info (and the precheck against it) is cached per server_id and
        trainer layout. With an update channel to every server (fsdpfn.rollout), a push whose
        layout was seen before costs no request at all: each channel is open, which shows the
        server is up and still holds the group (it closes the channel when it drops the group,
        and the OS closes it when the server exits). Otherwise one small /health request per
        server, and the full /get_model_info only after a server restart, a new group or
        another model."""
        layout = hash(layout)
        if self._prepared is not None and self._group is not None and \
                self.transport == "broadcast" and self._channels and \
                all(url in self._channels and not self._channels[url].stale()
                    and self._infos.get(url, (None, None))[1] == layout for url in self.urls):
            return self._prepared
        self._prepared = None
        for url in [u for u, ch in self._channels.items() if ch.stale()]:
            self._channels.pop(url).close()
        health = {url: call(url, "/health", timeout=self.timeout_s) for url in self.urls}
        for url, h in health.items():
            cached = self._infos.get(url)
            if cached is None or cached[0] != h.get("server_id") or cached[1] != layout \
                    or h.get("server_id") is None:
                info = call(url, "/get_model_info", timeout=self.timeout_s)
                self._infos[url] = (info.get("server_id"), layout, info)
        infos = {url: self._infos[url][2] for url in self.urls}
        kinds = {url: is_sglang(info) for url, info in infos.items()}
        if len(set(kinds.values())) > 1:
            raise WeightSyncError(f"urls: the servers must all be fsdpfn.rollout servers or all "
                                  f"SGLang servers, got SGLang for {kinds}")
        sglang = self._sglang = next(iter(kinds.values()))
        if sglang:
            return self._prepare_sglang(state)
        served = {url: info.get("dtype") for url, info in infos.items()}
        if self.dtype is not None:
            dtype = self.dtype
        elif len(set(served.values())) == 1:
            dtype = next(iter(served.values()))
        else:
            raise WeightSyncError(f"dtype: the servers serve different dtypes {served}; pass "
                                  f"RolloutTarget(dtype=...) explicitly")
        if self.precheck:
            for url, info in infos.items():
                try:
                    _precheck(url, info, params, dtype)
                except WeightSyncError:
                    self._infos.pop(url, None)  # look again next time
                    raise
        on_cuda = state.mesh.device_type == "cuda" and all(
            str(info.get("device", "cpu")).startswith("cuda") for info in infos.values())
        backend = self.backend or ("nccl" if on_cuda else "gloo")
        if self.transport == "broadcast":
            stale = self._group is None or self._group[2] != backend or any(
                self.group_name not in h.get("groups", ()) for h in health.values())
            if stale:
                self._init_group(backend, state.mesh.device)
            self._open_channels(infos)
            if all(url in self._channels for url in self.urls):
                self._prepared = (dtype, backend, False)
        return dtype, backend, False

    def _prepare_sglang(self, state: EngineState) -> tuple[str, str, bool]:
        """SGLang reports no parameters and no dtype: the push dtype is ``dtype`` or the
        trainer's compute dtype, and nothing is prechecked (the probe checks afterwards). Its
        /health shows no groups: the group is kept until a failure retires it."""
        if self.transport == "ipc":
            raise WeightSyncError("transport: 'ipc' needs fsdpfn.rollout servers "
                                  "(/update_weights_from_ipc); SGLang servers take "
                                  "'broadcast' or 'disk', got 'ipc'")
        dtype = self.dtype or state.config.dtype
        backend = self.backend or ("nccl" if state.mesh.device_type == "cuda" else "gloo")
        if self.transport == "broadcast" and (self._group is None
                                              or self._group[2] != backend):
            self._init_group(backend, state.mesh.device)
        return dtype, backend, True

    def _open_channels(self, infos: dict[str, dict]) -> None:
        """An update channel to every server that offers one (bound to the live group). A server
        whose channel cannot be reached is pushed to over HTTP (all servers then are)."""
        if not self.channel:
            return
        for url, info in infos.items():
            port = info.get("update_channel")
            unreachable = (url, info.get("server_id"), port)
            if url in self._channels or not port or unreachable in self._unreachable:
                continue
            host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
            try:
                self._channels[url] = Channel(url, host, int(port), self.group_name,
                                              min(self.timeout_s, 10.0))
            except WeightSyncError as exc:  # this push goes over HTTP
                if getattr(exc, "unreachable", False):
                    # not tried again for this server process (a firewalled port would cost a
                    # connection timeout per push)
                    self._unreachable.add(unreachable)

    def _address(self) -> str:
        if self.master_address:
            return self.master_address
        hosts = [urllib.parse.urlparse(u).hostname or "" for u in self.urls]
        if all(h in _LOOPBACK for h in hosts):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((hosts[0], 9))  # a UDP connect sends nothing: it only picks the route
            return s.getsockname()[0]

    def _init_group(self, backend: str, device: torch.device) -> None:
        self.retire()
        address = self._address()
        port = self.master_port or free_port(address)
        if self._sglang:
            self._builds += 1  # SGLang keeps a dropped group's name: never reuse one
            self._wire_group = self.group_name if self._builds == 1 else \
                f"{self.group_name}.{self._builds}"
            sizes = [server_ranks(url, self.timeout_s) for url in self.urls]
        else:
            self._wire_group = self.group_name
            sizes = [1] * len(self.urls)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world = 1 + sum(sizes)
        deadline = time.monotonic() + self.init_timeout_s
        bodies = {url: {"master_address": address, "master_port": port, "rank_offset": offset,
                        "world_size": world, "group_name": self._wire_group, "backend": backend}
                  for url, offset in zip(self.urls, offsets)}
        if not self._sglang:
            for body in bodies.values():
                body["timeout_s"] = self.timeout_s
        calls = [Call(lambda url=url: call(url, "/init_weights_update_group", bodies[url],
                                           timeout=self.init_timeout_s),
                      f"server {url}: /init_weights_update_group")
                 for url in self.urls]
        build = make_sglang_group if self._sglang else functools.partial(make_group, rank=0)
        try:
            group = build(master_address=address, master_port=port, world_size=world,
                          group_name=self._wire_group, backend=backend,
                          timeout_s=self.init_timeout_s, device=device)
        except Exception as exc:  # noqa: BLE001 - the servers' answers say more: prefer them
            for c in calls:
                c.result(min(deadline, time.monotonic() + 5.0))
            raise WeightSyncError(f"init_weights_update_group: building group "
                                  f"{self.group_name!r} ({backend}, {address}:{port}, "
                                  f"{world} members) failed: {type(exc).__name__}: {exc}") from None
        for c in calls:
            c.result(deadline)
        pg = group[1]
        if backend == "gloo" and hasattr(pg, "set_timeout"):
            pg.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        self._group = (*group, backend)

    def retire(self) -> None:
        """Rank 0: stop using the current group (the next push builds a new one)."""
        self._prepared = None
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        if self._group is not None:
            group, self._group = self._group, None
            if group[2] == "nccl":
                try:
                    group[1].abort()
                except Exception:  # noqa: BLE001 - best effort on a broken communicator
                    pass
            self._retired.append(group)

    def close(self) -> None:
        """Rank 0: ask the servers to drop the group (best effort) and forget it."""
        if is_rank_zero() and self._group is not None:
            for url in self.urls:
                try:
                    call(url, "/destroy_weights_update_group", {"group_name": self._wire_group},
                         timeout=min(self.timeout_s, 10.0))
                except WeightSyncError:
                    pass
            self.retire()

    # ------------------------------------------------------------ rank 0: pause and disk

    def _pause(self) -> None:
        if self.pause_generation:
            body = {"mode": self.pause_mode} if self._sglang else {}
            for url in self.urls:
                call(url, "/pause_generation", body, timeout=self.timeout_s)

    def _continue(self, *, strict: bool) -> None:
        if not self.pause_generation:
            return
        errors = []
        for url in self.urls:
            try:
                call(url, "/continue_generation", {}, timeout=min(self.timeout_s, 30.0))
            except WeightSyncError as exc:
                errors.append(str(exc))
        if errors and strict:
            raise WeightSyncError("; ".join(errors))

    def _load_from_disk(self, directory: Path, version: int, checksum: int) -> None:
        payload = {"model_path": str(directory.resolve()), "weight_version": version,
                   "flush_cache": self.flush_cache, "verify_checksums": True}
        self._pause()
        try:
            deadline = time.monotonic() + self.timeout_s
            calls = {url: Call(lambda url=url: call(url, "/update_weights_from_disk", payload,
                                                    timeout=self.timeout_s),
                               f"server {url}: /update_weights_from_disk")
                     for url in self.urls}
            answers = {}
            errors = []
            for url, c in calls.items():
                try:
                    answers[url] = c.result(deadline + 1.0)
                except WeightSyncError as exc:
                    errors.append(str(exc))
            if errors:
                raise WeightSyncError("; ".join(errors))
            for url, answer in answers.items():
                _check_commit(url, answer, version, checksum)
        except BaseException:
            self._continue(strict=False)
            raise
        self._continue(strict=True)


    def _load_from_disk_sglang(self, directory: Path, version: int, checksum: int) -> None:
        """SGLang's /update_weights_from_disk (its fields; the answer carries success and
        message only), generation paused around it; then its /get_weight_version."""
        from fsdpfn.weights.sglang import check_versions, disk_request

        payload = disk_request(str(directory.resolve()), version=version,
                               flush_cache=self.flush_cache)
        self._pause()
        try:
            deadline = time.monotonic() + self.timeout_s
            calls = [Call(lambda url=url: call(url, "/update_weights_from_disk", payload,
                                               timeout=self.timeout_s),
                          f"server {url}: /update_weights_from_disk") for url in self.urls]
            errors = []
            for c in calls:
                try:
                    c.result(deadline + 1.0)
                except WeightSyncError as exc:
                    errors.append(str(exc))
            if errors:
                raise WeightSyncError("; ".join(errors))
        except BaseException:
            self._continue(strict=False)
            raise
        self._continue(strict=True)
        check_versions(self.urls, version, self.timeout_s)


def _precheck(url: str, info: dict, params, dtype: str) -> None:
    served = info.get("params") or {}
    ours = {name: list(p.shape) for name, p in params}
    problems = []
    unknown = [n for n in ours if n not in served]
    missing = [n for n in served if n not in ours]
    if unknown:
        problems.append(f"tensor {unknown[0]!r}: name must be a parameter of the served model, "
                        f"got {len(unknown)} unknown names (e.g. {unknown[:3]})")
    if missing:
        problems.append(f"tensor {missing[0]!r}: the served model has it, the trainer does not "
                        f"({len(missing)} such, e.g. {missing[:3]})")
    for name, shape in ours.items():
        if name in served and list(served[name]["shape"]) != shape:
            problems.append(f"tensor {name!r}: shape must equal the served "
                            f"{served[name]['shape']}, got {shape}")
        if name in served and served[name]["dtype"] != dtype:
            problems.append(f"tensor {name!r}: dtype must equal the served "
                            f"{served[name]['dtype']}, got {dtype}")
    if problems:
        more = f"; ... {len(problems) - 4} more" if len(problems) > 4 else ""
        raise WeightSyncError(f"server {url}: the trainer's weights do not match the served "
                              f"model ({info.get('model_path')}): " + "; ".join(problems[:4])
                              + more)


def _check_commit(url: str, answer: dict, version: int, checksum: int) -> None:
    if answer.get("weight_version") != version:
        raise WeightSyncError(f"server {url}: weight_version after the update must be {version}, "
                              f"got {answer.get('weight_version')!r}")
    if answer.get("weights_checksum") != checksum:
        raise WeightSyncError(f"server {url}: weights_checksum after the update must equal the "
                              f"checksum of the pushed weights {checksum}, got "
                              f"{answer.get('weights_checksum')!r} (the server does not hold "
                              f"what was sent)")


class _BroadcastSender:
    """Rank 0: metadata over HTTP (a thread per server) + one async flat broadcast per bucket."""

    def __init__(self, target: RolloutTarget, buckets: list[Bucket], version: int):
        self.start_before_finish = target.pipeline
        self.target = target
        self.buckets = buckets
        self.version = version
        self.update_id = uuid.uuid4().hex
        self.checksums: list[tuple[list[str], torch.Tensor]] = []  # per bucket, on the device
        self.paused = False
        self.final_answers: dict[str, dict] = {}

    def start(self, bucket: Bucket, flat: torch.Tensor):
        t = self.target
        store, pg, backend = t._group  # noqa: SLF001
        last = bucket.index == len(self.buckets) - 1
        if last and t.pause_generation:
            self.paused = True
            t._pause()  # noqa: SLF001
        payload = {**bucket.metadata, "group_name": t.group_name,
                   "flush_cache": bool(last and t.flush_cache), "load_format": "flattened_bucket",
                   "weight_version": self.version, "update_id": self.update_id,
                   "bucket_index": bucket.index, "commit": last}
        calls = {url: Call(lambda url=url: call(url, "/update_weights_from_distributed", payload,
                                                timeout=t.timeout_s),
                           f"server {url}: /update_weights_from_distributed")
                 for url in t.urls}
        # ordered after the gather's copies on the current stream; the padded tail stays here
        work = broadcast(pg, flat[:bucket.nbytes])
        _queue_checksum(self.checksums, bucket, flat)
        if t.on_bucket is not None:
            t.on_bucket(bucket.index, len(self.buckets))
        return bucket, calls, work, flat, backend, time.monotonic() + t.timeout_s

    def finish(self, handle) -> None:
        bucket, calls, work, flat, backend, deadline = handle
        wire_error = _wait(work, backend, deadline)
        if wire_error is not None:
            deadline = min(deadline, time.monotonic() + 2.0)  # the servers may explain
        errors, answers = [], {}
        for url, c in calls.items():
            try:
                answers[url] = c.result(deadline)
            except WeightSyncError as exc:
                errors.append(str(exc))
        where = _where(self.target, bucket, len(self.buckets))
        if errors:
            raise WeightSyncError("; ".join(errors) + f" {where}")
        if wire_error is not None:
            raise WeightSyncError(f"broadcast to {self.target.urls} failed: {wire_error} {where}")
        _add_server_timings(self.target.last_timings, answers)
        if bucket.index == len(self.buckets) - 1:
            self.final_answers = answers

    def conclude(self) -> None:
        """After the last bucket: checksums, continue generation, versions."""
        checksum = _sent_checksum(self.checksums)
        for url, answer in self.final_answers.items():
            _check_commit(url, answer, self.version, checksum)
        if self.paused:
            self.paused = False
            self.target._continue(strict=True)  # noqa: SLF001

    def abandon(self) -> None:
        """After a failure: the group may be out of step (drop it); never leave generation
        paused."""
        self.target.retire()
        if self.paused:
            self.paused = False
            self.target._continue(strict=False)  # noqa: SLF001


class _OneRequestSender:
    """Rank 0, for servers that take a whole update in one request (fsdpfn.rollout advertises
    multi_bucket): one HTTP request carries every bucket's metadata and is posted before the
    first bucket is gathered; the server posts every receive, the broadcasts follow with two
    buckets in flight, and the answer (after the server's commit, generation paused around the
    swap when asked) is read at the end. No HTTP round trip per bucket."""

    start_before_finish = True

    def __init__(self, target: RolloutTarget, buckets: list[Bucket], version: int):
        self.target = target
        self.buckets = buckets
        self.version = version
        self.checksums: list[tuple[list[str], torch.Tensor]] = []
        t = target
        payload = {"buckets": [b.metadata for b in buckets], "group_name": t.group_name,
                   "flush_cache": t.flush_cache, "load_format": "flattened_bucket",
                   "weight_version": version, "update_id": uuid.uuid4().hex,
                   "pause_generation": t.pause_generation, "commit": True}
        self.calls = {url: Call(lambda url=url: call(url, "/update_weights_from_distributed",
                                                     payload, timeout=t.timeout_s
                                                     * max(1, len(buckets))),
                                f"server {url}: /update_weights_from_distributed")
                      for url in t.urls}

    def _server_error(self) -> str | None:
        for c in self.calls.values():
            if c.done():
                try:
                    c.result(time.monotonic())
                except WeightSyncError as exc:
                    return str(exc)
        return None

    def start(self, bucket: Bucket, flat: torch.Tensor):
        t = self.target
        _, pg, backend = t._group  # noqa: SLF001
        work = broadcast(pg, flat[:bucket.nbytes])  # before the checksum: not held up by it
        _queue_checksum(self.checksums, bucket, flat)
        if t.on_bucket is not None:
            t.on_bucket(bucket.index, len(self.buckets))
        return bucket, work, flat, time.monotonic() + t.timeout_s

    def _watch(self, wait_s: float) -> None:
        """A server that failed answers before the wire completes: raise its error."""
        error = self._server_error()
        if error is not None:
            raise WeightSyncError(error)
        time.sleep(wait_s)

    def finish(self, handle) -> None:
        bucket, work, flat, deadline = handle
        _await_wire(work, deadline, self.target, bucket, len(self.buckets), self._watch)

    def conclude(self) -> None:
        checksum = _sent_checksum(self.checksums)
        deadline = time.monotonic() + self.target.timeout_s
        errors, answers = [], {}
        for url, c in self.calls.items():
            try:
                answers[url] = c.result(deadline)
            except WeightSyncError as exc:
                errors.append(str(exc))
        if errors:
            raise WeightSyncError("; ".join(errors))
        _add_server_timings(self.target.last_timings, answers)
        for url, answer in answers.items():
            _check_commit(url, answer, self.version, checksum)

    def abandon(self) -> None:
        self.target.retire()


class _ChannelSender:
    """Rank 0, over update channels (fsdpfn.rollout): the update message goes out before the
    first bucket is gathered (its layout only the first time); each server checks it and answers
    "accepted" before any byte is broadcast, so a refused update never leaves a server waiting
    for bytes; the broadcasts follow without waiting for each other (gather_and_send's memory bound);
    each server answers once more after its commit. While waiting on the wire the channels are
    watched: a server's failure or exit is seen at once, not at the timeout."""

    start_before_finish = True

    def __init__(self, target: RolloutTarget, buckets: list[Bucket], version: int,
                 layout_id: int):
        self.target = target
        self.buckets = buckets
        self.version = version
        self.checksums: list[tuple[list[str], torch.Tensor]] = []
        self.channels = {url: target._channels[url] for url in target.urls}  # noqa: SLF001
        self.answers: dict[str, dict] = {}
        self.accepted = False
        # with target.timeline (benchmarks, CUDA): GPU and host times of each bucket, both ends
        self.timeline = {"t0_ms": (time.perf_counter() - target._clock) * 1e3,  # noqa: SLF001
                         "events": [_timing_event()], "launch_ms": []} \
            if target.timeline and torch.cuda.is_available() else None
        message = {"op": "update", "layout_id": layout_id, "group_name": target.group_name,
                   "weight_version": version, "update_id": uuid.uuid4().hex,
                   "pause_generation": target.pause_generation,
                   "flush_cache": target.flush_cache, "load_format": "flattened_bucket",
                   "timeline": self.timeline is not None}
        metadata = None
        for ch in self.channels.values():
            if layout_id not in ch.layouts:
                metadata = metadata or [b.metadata for b in buckets]
                ch.send({**message, "buckets": metadata})
                ch.layouts.add(layout_id)
            else:
                ch.send(message)

    def start(self, bucket: Bucket, flat: torch.Tensor):
        t = self.target
        if not self.accepted:
            deadline = time.monotonic() + t.timeout_s
            for url, ch in self.channels.items():
                answer = ch.read(deadline, "the update")
                if not answer.get("accepted"):
                    raise WeightSyncError(f"server {url}: the update channel must answer "
                                          f"'accepted' first, got {str(answer)[:200]}")
            self.accepted = True
            t.last_timings["accepted"] = time.perf_counter() - t._clock  # noqa: SLF001
        _, pg, _ = t._group  # noqa: SLF001
        if self.timeline is not None:
            self.timeline["launch_ms"].append((time.perf_counter() - t._clock) * 1e3)  # noqa: SLF001
            gathered = _timing_event()
        work = broadcast(pg, flat[:bucket.nbytes])  # before the checksum: not held up by it
        if self.timeline is not None:
            if "stream" not in self.timeline:
                self.timeline["stream"] = torch.cuda.Stream()
            side = self.timeline["stream"]
            with torch.cuda.stream(side):
                work.wait()
                self.timeline["events"].append((gathered, _timing_event(side)))
        _queue_checksum(self.checksums, bucket, flat)
        if bucket.index == 0:
            t.last_timings["first_send"] = time.perf_counter() - t._clock  # noqa: SLF001
        if t.on_bucket is not None:
            t.on_bucket(bucket.index, len(self.buckets))
        return bucket, work, time.monotonic() + t.timeout_s

    def _watch(self, wait_s: float) -> None:
        """Read whatever a server sent meanwhile (its final answer, or its failure: raised)."""
        waiting = [ch.sock for url, ch in self.channels.items() if url not in self.answers]
        if not waiting:
            time.sleep(wait_s)
            return
        ready = wait_readable(waiting, wait_s)
        for url, ch in self.channels.items():
            if ch.sock in ready:
                self.answers[url] = ch.read(time.monotonic() + self.target.timeout_s,
                                            "the update")

    def finish(self, handle) -> None:
        bucket, work, deadline = handle
        _await_wire(work, deadline, self.target, bucket, len(self.buckets), self._watch)

    def conclude(self) -> None:
        checksum = _sent_checksum(self.checksums)
        deadline = time.monotonic() + self.target.timeout_s
        for url, ch in self.channels.items():
            if url not in self.answers:
                self.answers[url] = ch.read(deadline, "the update")
        _add_server_timings(self.target.last_timings, self.answers)
        for url, answer in self.answers.items():
            _check_commit(url, answer, self.version, checksum)
        if self.timeline is not None:
            t0, *pairs = self.timeline["events"]
            self.target.last_timeline = {
                "t0_ms": self.timeline["t0_ms"], "launch_ms": self.timeline["launch_ms"],
                "gathered_ms": [t0.elapsed_time(g) for g, _ in pairs],
                "sent_ms": [t0.elapsed_time(e) for _, e in pairs],
                "bucket_bytes": [b.nbytes for b in self.buckets],
                "servers": {url: a.get("timeline") for url, a in self.answers.items()}}

    def abandon(self) -> None:
        self.target.retire()


def _await_wire(work, deadline: float, target: RolloutTarget, bucket: Bucket, n_buckets: int,
                watch: Callable[[float], None]) -> None:
    """Wait for a bucket's broadcast, calling watch(seconds) between polls (it raises
    WeightSyncError when a server failed meanwhile); every failure is a WeightSyncError naming
    the bucket."""
    where = _where(target, bucket, n_buckets)
    try:
        while not work.is_completed():
            watch(0.0002)
            if time.monotonic() > deadline:
                raise WeightSyncError(f"broadcast to {target.urls} did not complete within "
                                      f"timeout_s")
        work.wait()
    except WeightSyncError as exc:
        raise WeightSyncError(f"{exc} {where}") from None
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError
        raise WeightSyncError(f"broadcast to {target.urls} failed: {type(exc).__name__}: "
                              f"{exc} {where}") from None


def _where(target: RolloutTarget, bucket: Bucket, n_buckets: int) -> str:
    """The bucket a failure happened in, for its message."""
    return (f"[bucket {bucket.index} of {n_buckets}, {len(bucket.specs)} tensors from "
            f"{bucket.names[0]!r}, {bucket.nbytes} bytes; timeout_s={target.timeout_s:g}]")


def _timing_event(stream=None):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _queue_checksum(checksums: list, bucket: Bucket, flat: torch.Tensor) -> None:
    """Queue the checksums of a bucket on the device, after its broadcast (they read the buffer
    while the wire does); read once, by _sent_checksum: no synchronisation per bucket."""
    checksums.append((bucket.names, flat_checksums(flat, bucket.offsets, bucket.sizes)))


def _sent_checksum(checksums: list) -> int:
    """The weights checksum of everything sent (one synchronisation)."""
    names = [n for batch, _ in checksums for n in batch]
    return int(combine_on_device(torch.cat([v for _, v in checksums]), names))


def _add_server_timings(timings: dict[str, float], answers: dict[str, dict]) -> None:
    """The servers' own account of their seconds, summed into ``timings`` as server_<phase>."""
    for answer in answers.values():
        for key, value in (answer.get("seconds") or {}).items():
            if isinstance(value, (int, float)):
                timings[f"server_{key}"] = timings.get(f"server_{key}", 0.0) + value


def _wait(work, backend: str, deadline: float) -> str | None:
    """Wait for a broadcast until ``deadline``; the error text, or None when it completed."""
    try:
        wait_work(work, backend, deadline - time.monotonic())
        return None
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError, NCCL TimeoutError
        return f"{type(exc).__name__}: {exc}"
