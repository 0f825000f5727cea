"""transport="ipc" of a RolloutTarget (servers on trainer rank 0's own GPU, where NCCL cannot
connect the two processes): rank 0 shares each gathered bucket, as it is (the aligned flat bucket
of fsdpfn.wire.protocol, the update channel's layout), by its CUDA IPC handle, and sends every
handle in one /update_weights_from_ipc request per server; each server copies the buckets into
memory of its own, checks them on the device as the update channel's receiver does, and swaps
them in; the buffers are freed after its answer. The handle format lives in fsdpfn.wire.ipc."""

from __future__ import annotations

import torch

from fsdpfn.agree import is_rank_zero
from fsdpfn.errors import ConfigError
from fsdpfn.engine.state import EngineState
from fsdpfn.weights.channel import SentChecksums, check_commit
from fsdpfn.weights.gather import Bucket, send
from fsdpfn.wire.http import call
from fsdpfn.wire.ipc import share

__all__ = ["IpcSender", "push_ipc", "hand_back_needed"]

HEADROOM = 2 << 30  # bytes kept free beside the buckets' copies (the servers' own workspace)


class IpcSender:
    """Rank 0's side of an IPC push (a fsdpfn.weights.gather.Sender): each gathered flat bucket
    kept alive until the servers answered, its handle recorded and its checksums queued on the
    device (read once, at the end); ``conclude`` sends every handle in one
    /update_weights_from_ipc request per server, generation paused around it."""

    flat = True
    start_before_finish = True

    def __init__(self, servers, version: int, *, merged_adapters: bool = False):
        self.servers = servers
        self.merged_adapters = merged_adapters
        self.version = version
        self.buffers: list[torch.Tensor] = []
        self.buckets: list[dict] = []
        self.checksums = SentChecksums()

    def start(self, bucket: Bucket, flat: torch.Tensor):
        self.buffers.append(flat)
        self.checksums.add(bucket, flat)
        self.buckets.append({**bucket.metadata, "handle": share(flat)})

    def finish(self, handle) -> None:
        return None

    def conclude(self) -> None:
        checksum = self.checksums.value()  # also: every buffer is complete before any read
        servers = self.servers
        # the server refuses, before its swap, what does not have the checksum sent, and swaps
        # within the call's timeout or not at all
        payload = {"buckets": self.buckets, "weight_version": self.version,
                   "flush_cache": servers.config.flush_cache,
                   "merged_adapters": self.merged_adapters, "weights_checksum": checksum,
                   "timeout_s": servers.config.timeout_s}
        servers.pause()
        try:
            applied = 0.0
            for url in servers.urls:
                answer = call(url, "/update_weights_from_ipc", payload,
                              timeout=servers.config.timeout_s)
                check_commit(url, answer, self.version, checksum)
                applied += float((answer.get("seconds") or {}).get("apply", 0.0))
            servers.last_apply_s = applied
        finally:
            servers.resume(strict=False)
            self.buffers.clear()

    def abandon(self) -> None:
        self.buffers.clear()


def push_ipc(state: EngineState, params, buckets: list[Bucket], servers) -> tuple[int, int]:
    """Collective: every rank gathers; rank 0 packs each bucket into a device buffer of its own
    and hands the servers (on rank 0's GPU) their IPC handles; the buffers are freed once every
    server answered."""
    if state.mesh.device_type != "cuda":
        raise ConfigError(f"transport: 'ipc' shares CUDA memory and this trainer runs on "
                          f"{state.mesh.device_type}; use 'broadcast' or 'disk', got 'ipc'")
    # the servers copy each bucket into memory of their own on this GPU, beside the trainer's
    # buffers of the same buckets: where the GPU lacks room for them, the blocks the trainer's
    # allocator keeps cached since the step go back first (a 7B step left none for the
    # server). Only then: handing them back costs the push its time and the next step its
    # allocations (BENCHMARKS.md, "The main job": the 1.5B push stage doubled when it ran on
    # every push)
    if hand_back_needed(torch.cuda.mem_get_info(state.mesh.device)[0],
                        sum(b.nbytes for b in buckets), len(servers.urls)):
        torch.cuda.empty_cache()
    sender = IpcSender(servers, state.version, merged_adapters=state.config.lora is not None) \
        if is_rank_zero() else None
    return send(state, params, buckets, sender, out_device=state.mesh.device)


def hand_back_needed(free: int, bucket_bytes: int, servers: int) -> bool:
    """Whether the trainer's cached blocks must go back before an IPC push: the GPU's ``free``
    bytes cannot hold the trainer's buffers of the buckets (``bucket_bytes`` in all) and each
    of the ``servers``' copies of them, with HEADROOM to spare. The buffers are counted as new
    memory although the trainer's cache may serve them: the rule errs towards handing back."""
    return free < (1 + max(servers, 1)) * bucket_bytes + HEADROOM
