"""push_weights: copy a live state's weights to rollout servers (RolloutTarget) or a directory
(fsdpfn.weights.disk.DiskTarget); read-only.

A RolloutTarget pushes by one of four transports, each one path, each a Sender
(fsdpfn.weights.gather) driven by the same gather schedule:

- the update channel (``transport="broadcast"`` to fsdpfn.rollout servers that offer one;
  fsdpfn.weights.channel): trainer rank 0 and the servers share a process group (NCCL between
  GPUs, else gloo) formed once as SGLang forms it and reused across pushes; a TCP connection per
  server carries the update (its bucket layout the first time, then its id), each server
  answers "accepted" before any byte is broadcast, checks each bucket as it lands, answers
  "ready" with the version and the checksum of what arrived, and swaps only on rank 0's
  "commit", sent once every server's checksum equals what was sent.
- SGLang's protocol (``transport="broadcast"`` to any other server: stock SGLang, or an
  fsdpfn.rollout server without a channel; fsdpfn.weights.sglang): per bucket, SGLang's
  /update_weights_from_distributed and one packed broadcast, generation paused throughout; then
  /get_weight_version and a log-prob probe against the trainer's forward_logp.
- CUDA IPC (``transport="ipc"``, servers on trainer rank 0's own GPU; fsdpfn.weights.ipc).
- disk (``transport="disk"``, ``disk_root`` shared with the servers; fsdpfn.weights.disk_push).

Per push: trainer rank 0 checks the servers (with an update channel open to every server and a
layout seen before, this costs nothing; else one /get_model_info per server: the push dtype, and
with ``precheck`` names, shapes and the model's config),
builds the group when needed; its verdict reaches every rank before any gather. Then every rank
gathers the buckets
(``bucket_bytes`` in the middle, ``edge_bucket_bytes`` at both ends) while rank 0 sends. Every
request and transfer is bounded by ``timeout_s`` (group set-up by ``init_timeout_s``); any
failure raises WeightSyncError on every rank, and each server keeps its previous weights (with
several servers, those that swapped before the failure keep the new version; the message says
which failed). Timing detail beyond PushReceipt comes from the profiler (``fsdpfn.push_weights``
and ``gather`` ranges).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Sequence

import attrs
import torch

from fsdpfn.engine import timing
from fsdpfn.agree import (capture_error, is_rank_zero, same_on_every_rank,
                                  share_from_rank_zero)
from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.wire.http import check_urls, is_http_url
from fsdpfn.engine.state import EngineState, check_live
from fsdpfn.weights.channel import ChannelSender
from fsdpfn.weights.disk_push import push_disk
from fsdpfn.weights.gather import Bucket, plan_buckets, send, weights_and_layout
from fsdpfn.weights.ipc import push_ipc
from fsdpfn.weights.push_config import PushConfig
from fsdpfn.weights.servers import Servers
from fsdpfn.weights.sglang import SGLangSender, probe
from fsdpfn.wire.protocol import dtype_from_name

__all__ = ["push_weights", "PushReceipt", "RolloutTarget"]


@attrs.frozen
class PushReceipt:
    """What a push delivered: the weights ``version`` (== state.version), the number of tensors
    and bytes sent (in the push dtype), and the wall time on this rank.

    Where the time went (None where not measured: ``EngineConfig.timing=False``, or a target
    whose servers report no seconds): ``gather_s``, this rank's time making the parameters
    whole (all-gathers and casts, device time on CUDA; it overlaps sending the bucket before);
    ``apply_s``, the servers' own time from the last byte received to the new weights served
    (summed over servers); ``transfer_s``, the rest of ``seconds``: preparing, sending, waiting
    for the wire and the servers' answers (disk: writing the files).
    """

    version: int
    n_tensors: int
    n_bytes: int
    seconds: float
    gather_s: float | None = None
    transfer_s: float | None = None
    apply_s: float | None = None


def push_weights(state: EngineState, target) -> PushReceipt:
    """Push the weights of ``state`` to ``target`` (a DiskTarget or RolloutTarget). Collective:
    every trainer rank calls it. Never changes the state and never returns one.

    All ranks gather the parameters bucket by bucket in one fixed order; trainer rank 0 sends.
    Any failure raises WeightSyncError on every rank (rank 0's verdict is shared after each
    bucket), and the receiver keeps its previous weights.
    """
    start = time.perf_counter()
    error = None
    if not callable(getattr(target, "push", None)):
        error = ConfigError(_bad_target(target))
    elif isinstance(state, EngineState) and state.config.is_critic:
        error = WeightSyncError("push_weights: state must be an actor (a causal LM), got a "
                                "critic (is_critic=True); rollout engines serve policies")
    check_live(state, "push_weights", local_error=error)
    # every rank gathers the same buckets in the same dtype; what only rank 0 uses (URLs,
    # directories, timeouts) may differ. Options that change the gathers: one error if they do
    config = getattr(target, "config", None) or target
    same_on_every_rank("push_weights", {
        "target": type(target).__name__,
        **{f"target.{name}": getattr(config, name, None)
           for name in ("transport", "dtype", "bucket_bytes", "edge_bucket_bytes")}})
    profiling = timing.PROFILER.get() is not None
    with torch.profiler.record_function("fsdpfn.push_weights") if profiling \
            else contextlib.nullcontext():
        with timing.clock_for(state.mesh.device, measure=state.config.timing,
                              ranges=profiling) as clock:
            n_tensors, n_bytes = target.push(state)
    seconds = time.perf_counter() - start
    split = {}
    if clock.result is not None:
        gather = clock.result.get("gather", 0.0)
        apply = getattr(target, "last_apply_s", None)
        split = dict(gather_s=gather, apply_s=apply,
                     transfer_s=max(seconds - gather - (apply or 0.0), 0.0))
    return PushReceipt(version=state.version, n_tensors=n_tensors, n_bytes=n_bytes,
                       seconds=seconds, **split)


def _bad_target(target) -> str:
    """push_weights' message for a ``target`` without push(state): its repr (cut to 80
    characters) and type, and for a URL string the target that pushes to it."""
    shown = repr(target)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    hint = (f"; for the server at that URL pass RolloutTarget({target!r})"
            if is_http_url(target) else "")
    return (f"target: must be a DiskTarget or RolloutTarget (an object with push(state)), got "
            f"{shown} ({type(target).__name__}){hint}")


class RolloutTarget:
    """Push to rollout servers at ``urls`` (see the module doc), with the options of ``config``
    (a PushConfig; its doc gives each). ``config`` is the PushConfig in use, ``group_name``
    filled in when it was None. After a push, ``last_apply_s`` holds the servers' own seconds
    applying it (None when they did not say)."""

    def __init__(self, urls: str | Sequence[str], *, config: PushConfig | None = None):
        self.urls = check_urls(urls)
        config = PushConfig() if config is None else config
        if not isinstance(config, PushConfig):
            raise ConfigError(f"config: must be a PushConfig, got {type(config).__name__}")
        if config.group_name is None:
            config = attrs.evolve(config, group_name=f"fsdpfn-{uuid.uuid4().hex[:8]}")
        self.config = config
        self._servers = Servers(self.urls, config)  # used on rank 0 only
        self._plans: dict[tuple, tuple[int, list[Bucket]]] = {}  # (layout, dtype) -> (id, plan)

    def __repr__(self) -> str:
        return f"RolloutTarget({self.urls!r}, transport={self.config.transport!r})"

    @property
    def last_apply_s(self) -> float | None:
        return self._servers.last_apply_s

    def push(self, state: EngineState) -> tuple[int, int]:
        """Collective over the trainer ranks; returns (n_tensors, n_bytes). Rank 0 prepares
        (its verdict reaches every rank before any gather), then one transport sends."""
        params, layout = weights_and_layout(state)
        plan, error = (capture_error(lambda: self._servers.prepare(state, params, layout),
                                     "preparing the push")
                       if is_rank_zero() else (None, None))
        dtype_name, backend, sglang = share_from_rank_zero(plan, error)
        dtype = dtype_from_name(dtype_name)
        if self.config.transport == "disk":
            return push_disk(state, self._servers, dtype, sglang=sglang)
        layout_id, buckets = self._plan(params, layout, dtype)
        if self.config.transport == "ipc":
            return push_ipc(state, params, buckets, self._servers)
        sender = None
        if is_rank_zero():
            sender = SGLangSender(self._servers, buckets, state.version,
                                  merged_adapters=state.config.lora is not None) if sglang else \
                ChannelSender(self._servers, buckets, state.version, layout_id,
                              merged_adapters=state.config.lora is not None)
        sent = send(state, params, buckets, sender,
                    out_device=state.mesh.device if backend == "nccl" else torch.device("cpu"))
        if sglang:
            probe(state, self.urls, dtype, probe_tol=self.config.probe_tol,
                  timeout_s=self.config.timeout_s)
        return sent

    def _plan(self, params, layout: tuple, dtype: torch.dtype) -> tuple[int, list[Bucket]]:
        """(layout id, buckets), planned once per trainer layout and dtype."""
        key = (layout, dtype)
        if key not in self._plans:
            self._plans[key] = (len(self._plans), plan_buckets(
                params, dtype, self.config.bucket_bytes, self.config.edge_bucket_bytes))
        return self._plans[key]

    def retire(self) -> None:
        """Rank 0: stop using the current group (the next push builds a new one)."""
        self._servers.retire()

    def close(self) -> None:
        """Rank 0: ask the servers to drop the group (best effort) and forget it."""
        if is_rank_zero():
            self._servers.close()


