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

Where each part lives: the options, push_config (PushConfig); what rank 0 knows of the servers
(preparation, update channels, pause and resume), servers; the update group, update_group; the
broadcast senders, senders (over HTTP) and channel_sender (over update channels); SGLang's
protocol and probe, sglang; the disk and IPC transports, disk_push and ipc. RolloutTarget itself
only prepares, plans the buckets and hands the push to one of them.
"""

from __future__ import annotations

import uuid
from typing import Sequence

import attrs
import torch

from fsdpfn.agree import capture_error, is_rank_zero, share_from_rank_zero
from fsdpfn.errors import ConfigError
from fsdpfn.state import EngineState
from fsdpfn.weights.channel_sender import ChannelSender
from fsdpfn.weights.disk_push import push_disk
from fsdpfn.weights.gather import Bucket, plan_buckets, weights_and_layout
from fsdpfn.weights.ipc import push_ipc
from fsdpfn.weights.push_config import PAUSE_MODES, PushConfig
from fsdpfn.weights.senders import BroadcastSender, OneRequestSender, PushTimings, send_flat
from fsdpfn.weights.servers import Servers
from fsdpfn.weights.sglang import SGLangSender, probe
from fsdpfn.wire.protocol import dtype_from_name

__all__ = ["RolloutTarget", "PushConfig", "PAUSE_MODES"]

# the options of a push: PushConfig's fields, also readable as target.<option>
_OPTIONS = frozenset(f.name for f in attrs.fields(PushConfig))


class RolloutTarget:
    """Push to rollout servers at ``urls`` (see the module doc for the protocol).

    The options are one PushConfig (``config=PushConfig(transport="disk", disk_root=...)``, see
    its doc for each), or the same options as keywords (``RolloutTarget(url, timeout_s=30)``),
    not both. ``config`` is the PushConfig in use (``group_name`` filled in when it was None);
    each option also reads as an attribute (``target.timeout_s``). After a push,
    ``last_timings`` holds this rank's seconds per phase; ``timeline = True`` (benchmarks, CUDA)
    makes pushes over update channels record per-bucket GPU times into ``last_timeline``.
    """

    def __init__(self, urls: str | Sequence[str], *, config: PushConfig | None = None,
                 **options):
        self.urls = _check_urls(urls)
        config = _check_config(config, options)
        if config.group_name is None:
            config = attrs.evolve(config, group_name=f"fsdpfn-{uuid.uuid4().hex[:8]}")
        self.config = config
        self._servers = Servers(self.urls, config)  # used on rank 0 only
        self._timings = PushTimings()
        self._plans: dict[tuple, tuple[int, list[Bucket]]] = {}  # (layout, dtype) -> (id, plan)

    def __repr__(self) -> str:
        return f"RolloutTarget({self.urls!r}, transport={self.config.transport!r})"

    def __getattr__(self, name: str):
        # only called for names not found otherwise: the options read through to the config
        config = self.__dict__.get("config")
        if config is not None and name in _OPTIONS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in _OPTIONS:
            raise AttributeError(f"RolloutTarget.{name}: the options are fixed at construction; "
                                 f"build another target with config=attrs.evolve(target.config, "
                                 f"{name}=...), got an assignment of {value!r}")
        super().__setattr__(name, value)

    # ------------------------------------------------------------ measurements

    @property
    def last_timings(self) -> dict[str, float]:
        """This rank's seconds per phase of the last push: prepare (server checks, group),
        transfer (gather + send + the servers' commit), conclude (checksums, continue), and the
        servers' own ``server_<phase>``."""
        return self._timings.seconds

    @property
    def timeline(self) -> bool:
        return self._timings.timeline

    @timeline.setter
    def timeline(self, value: bool) -> None:
        self._timings.timeline = bool(value)

    @property
    def last_timeline(self) -> dict | None:
        return self._timings.last_timeline

    # rank 0's live update group (store, pg, backend) and update channels (None / {} elsewhere)
    @property
    def _group(self):
        return self._servers.group.live

    @property
    def _channels(self):
        return self._servers.channels

    # ------------------------------------------------------------ the collective push

    def push(self, state: EngineState) -> tuple[int, int]:
        """Collective over the trainer ranks; returns (n_tensors, n_bytes). Rank 0 prepares
        (its verdict reaches every rank before any gather), then the push goes by disk, SGLang's
        protocol, CUDA IPC or a broadcast to fsdpfn.rollout servers."""
        self._timings.begin()
        params, layout = weights_and_layout(state)
        plan, error = (capture_error(lambda: self._servers.prepare(state, params, layout),
                                     "preparing the push")
                       if is_rank_zero() else (None, None))
        dtype_str, backend, sglang = share_from_rank_zero(plan, error)
        dtype = dtype_from_name(dtype_str)
        self._timings.mark("prepare")
        if self.config.transport == "disk":
            return push_disk(state, self._servers, dtype, sglang)
        layout_id, buckets = self._plan(params, layout, dtype)
        if sglang:
            return self._push_sglang(state, params, buckets, dtype, backend)
        if self.config.transport == "ipc":
            return push_ipc(state, params, buckets, self._servers, self._timings)
        sender = self._broadcast_sender(buckets, state.version, layout_id)
        return send_flat(state, params, buckets, sender, backend, self._timings)

    def _plan(self, params, layout: tuple, dtype: torch.dtype) -> tuple[int, list[Bucket]]:
        """(layout id, buckets), planned once per trainer layout and dtype."""
        key = (layout, dtype)
        if key not in self._plans:
            self._plans[key] = (len(self._plans), plan_buckets(
                params, dtype, self.config.bucket_bytes, self.config.edge_bucket_bytes))
        return self._plans[key]

    def _broadcast_sender(self, buckets: list[Bucket], version: int, layout_id: int):
        """Rank 0's sender to fsdpfn.rollout servers (None elsewhere): over the update channels
        when every server has one open, else the whole update in one HTTP request when every
        server takes that (and ``one_request`` and ``pipeline``), else a request per bucket."""
        if not is_rank_zero():
            return None
        servers, cfg = self._servers, self.config
        if servers.over_channels():
            return ChannelSender(servers, self._timings, buckets, version, layout_id)
        if cfg.one_request and cfg.pipeline and servers.take_one_request():
            return OneRequestSender(servers, self._timings, buckets, version)
        return BroadcastSender(servers, self._timings, buckets, version)

    def _push_sglang(self, state: EngineState, params, buckets: list[Bucket],
                     dtype: torch.dtype, backend: str) -> tuple[int, int]:
        """SGLang's protocol (fsdpfn.weights.sglang): a request and a packed broadcast per
        bucket, one at a time, generation paused throughout; then its version and a probe."""
        sender = SGLangSender(self._servers, buckets, state.version) if is_rank_zero() else None
        sent = send_flat(state, params, buckets, sender, backend, self._timings)
        probe(state, self.urls, dtype, probe_tol=self.config.probe_tol,
              timeout_s=self.config.timeout_s)
        self._timings.mark("probe")
        return sent

    # ------------------------------------------------------------ the group's end

    def retire(self) -> None:
        """Rank 0: stop using the current group (the next push builds a new one)."""
        self._servers.retire()

    def close(self) -> None:
        """Rank 0: ask the servers to drop the group (best effort) and forget it."""
        if is_rank_zero():
            self._servers.close()


def _check_urls(urls) -> list[str]:
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                           for u in urls):
        raise ConfigError(f"urls: must be one or more 'http://host:port' strings, got {urls!r}")
    return [u.rstrip("/") for u in urls]


def _check_config(config: PushConfig | None, options: dict) -> PushConfig:
    """The PushConfig of a RolloutTarget: ``config``, or one built from keyword options."""
    if config is None:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise TypeError(f"RolloutTarget() got unexpected keyword argument(s) {unknown}; "
                            f"the options are PushConfig's fields {sorted(_OPTIONS)}")
        return PushConfig(**options)
    if not isinstance(config, PushConfig):
        raise ConfigError(f"config: must be a PushConfig, got {type(config).__name__}")
    if options:
        raise ConfigError(f"config: pass the options either as config=PushConfig(...) or as "
                          f"keywords, not both; got config and {sorted(options)}")
    return config
