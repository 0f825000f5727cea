"""fsdpfn.weights: push_weights and its transports.

    receipt = ff.push_weights(state, ff.RolloutTarget("http://127.0.0.1:30000"))  # broadcast
    receipt = ff.push_weights(state, ff.RolloutTarget(
        url, config=ff.PushConfig(transport="disk", disk_root="/shared")))
    receipt = ff.push_weights(state, ff.DiskTarget("/ckpt/push", keep_last=2))

Modules: push (push_weights, PushReceipt, RolloutTarget: prepares, plans, hands the push to one
transport), push_config (PushConfig, its options), gather (the fixed bucket schedule all ranks
follow, the Sender protocol and its one driver), servers (rank 0's view of the servers:
preparation, pause), update_group (the broadcast group, formed as SGLang forms it); the four
transports: channel (the update channel to fsdpfn.rollout servers), sglang (SGLang's protocol and
its probe), ipc (CUDA IPC, colocated), disk_push and disk (files; DiskTarget); adapter
(AdapterTarget, LoRA adapters alone). What both ends speak lives in fsdpfn.wire.
"""

from fsdpfn.weights.adapter import AdapterTarget
from fsdpfn.weights.disk import DiskTarget
from fsdpfn.weights.push import PushReceipt, RolloutTarget, push_weights
from fsdpfn.weights.push_config import PushConfig

__all__ = ["push_weights", "PushReceipt", "DiskTarget", "RolloutTarget", "PushConfig",
           "AdapterTarget"]
