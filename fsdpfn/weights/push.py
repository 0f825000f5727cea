"""push_weights: copy a live state's weights to a rollout engine or a directory; read-only."""

from __future__ import annotations

import time

import attrs

from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.state import EngineState, check_live

__all__ = ["push_weights", "PushReceipt"]


@attrs.frozen
class PushReceipt:
    """What a push delivered: the weights ``version`` (== state.version), the number of tensors
    and bytes sent (in the push dtype), and the wall time on this rank."""

    version: int
    n_tensors: int
    n_bytes: int
    seconds: float


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
        error = ConfigError(f"target: must be a DiskTarget or RolloutTarget (an object with "
                            f"push(state)), got {type(target).__name__}")
    elif isinstance(state, EngineState) and state.config.is_critic:
        error = WeightSyncError("push_weights: state must be an actor (a causal LM), got a "
                                "critic (is_critic=True); rollout engines serve policies")
    check_live(state, "push_weights", local_error=error)
    n_tensors, n_bytes = target.push(state)
    return PushReceipt(version=state.version, n_tensors=n_tensors, n_bytes=n_bytes,
                       seconds=time.perf_counter() - start)
