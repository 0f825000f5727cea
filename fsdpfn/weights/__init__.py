"""fsdpfn.weights: push_weights and its transports.

    receipt = ff.push_weights(state, ff.RolloutTarget("http://127.0.0.1:30000"))  # broadcast
    receipt = ff.push_weights(state, ff.RolloutTarget(url, transport="disk", disk_root="/shared"))
    receipt = ff.push_weights(state, ff.RolloutTarget(url, config=ff.PushConfig(timeout_s=30)))
    receipt = ff.push_weights(state, ff.DiskTarget("/ckpt/push", keep_last=2))

Modules: push (push_weights, PushReceipt), gather (the fixed bucket schedule all ranks follow),
disk (DiskTarget, atomic versioned safetensors), rollout_target (RolloutTarget: prepares, plans
and dispatches), push_config (PushConfig, its options), servers (rank 0's view of the servers:
preparation, update channels, pause), update_group (the broadcast group), senders and
channel_sender (the broadcast over HTTP and over update channels), sglang (the push to stock
SGLang servers, in SGLang's protocol), disk_push and ipc (the disk and CUDA IPC transports),
protocol (formats and checksums shared with fsdpfn.rollout), http (the stdlib client).
"""

from fsdpfn.weights.disk import DiskTarget
from fsdpfn.weights.push import PushReceipt, push_weights
from fsdpfn.weights.push_config import PushConfig
from fsdpfn.weights.rollout_target import RolloutTarget

__all__ = ["push_weights", "PushReceipt", "DiskTarget", "RolloutTarget", "PushConfig"]
