"""fsdpfn.weights: push_weights and its transports.

    receipt = ff.push_weights(state, ff.RolloutTarget("http://127.0.0.1:30000"))  # broadcast
    receipt = ff.push_weights(state, ff.RolloutTarget(url, transport="disk", disk_root="/shared"))
    receipt = ff.push_weights(state, ff.DiskTarget("/ckpt/push", keep_last=2))

Modules: push (push_weights, PushReceipt), gather (the fixed bucket schedule all ranks follow),
disk (DiskTarget, atomic versioned safetensors), rollout_target (RolloutTarget: HTTP control and
the broadcast group), sglang (the push to stock SGLang servers, in SGLang's protocol), protocol
(formats and checksums shared with fsdpfn.rollout), http (the stdlib client).
"""

from fsdpfn.weights.disk import DiskTarget
from fsdpfn.weights.push import PushReceipt, push_weights
from fsdpfn.weights.rollout_target import RolloutTarget

__all__ = ["push_weights", "PushReceipt", "DiskTarget", "RolloutTarget"]
