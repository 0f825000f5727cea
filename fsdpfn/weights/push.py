"""push_weights: copy a live state's weights to a rollout engine or a directory; read-only."""

from __future__ import annotations

import contextlib
import time

import attrs
import torch

from fsdpfn import timing
from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.state import EngineState, check_live

__all__ = ["push_weights", "PushReceipt"]


@attrs.frozen
class PushReceipt:
    """What a push delivered: the weights ``version`` (== state.version), the number of tensors
    and bytes sent (in the push dtype), and the wall time on this rank.

    Where the time went (None where not measured: ``EngineConfig.timing=False``, or a target
    whose servers report no seconds): ``gather_s``, this rank's time making the parameters
    whole (all-gathers and casts, device time on CUDA; it overlaps sending the bucket before);
    ``apply_s``, the servers' own time putting the received weights in place and checking them
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
        error = ConfigError(f"target: must be a DiskTarget or RolloutTarget (an object with "
                            f"push(state)), got {type(target).__name__}")
    elif isinstance(state, EngineState) and state.config.is_critic:
        error = WeightSyncError("push_weights: state must be an actor (a causal LM), got a "
                                "critic (is_critic=True); rollout engines serve policies")
    check_live(state, "push_weights", local_error=error)
    profiling = timing.PROFILER.get() is not None
    with torch.profiler.record_function("fsdpfn.push_weights") if profiling \
            else contextlib.nullcontext():
        with timing.clock_for(state.mesh.device, measure=state.config.timing,
                              ranges=profiling) as clock:
            n_tensors, n_bytes = target.push(state)
    seconds = time.perf_counter() - start
    return PushReceipt(version=state.version, n_tensors=n_tensors, n_bytes=n_bytes,
                       seconds=seconds, **_split(clock.result, target, seconds))


def _split(measured: dict | None, target, seconds: float) -> dict:
    """gather_s, transfer_s, apply_s of one push (empty when not measured)."""
    if measured is None:
        return {}
    gather = measured.get("gather", 0.0)
    apply = _apply_seconds(getattr(target, "last_timings", None) or {})
    return dict(gather_s=gather, apply_s=apply,
                transfer_s=max(seconds - gather - (apply or 0.0), 0.0))


def _apply_seconds(timings: dict) -> float | None:
    """The servers' seconds applying an update, from their answers (RolloutTarget.last_timings,
    ``server_<phase>`` summed over servers). An update in one request reports clocks from its
    start: queue (receives posted), swap (weights pointed at the new tensors), wait (every byte
    arrived), commit (checked and done); applying is swap - queue plus commit - wait. A
    bucket-by-bucket update reports the commit's own duration."""
    if "server_post" in timings and "server_commit" in timings:
        swap = max(timings.get("server_swap", 0.0) - timings.get("server_queue", 0.0), 0.0)
        return swap + max(timings["server_commit"] - timings.get("server_wait", 0.0), 0.0)
    return timings.get("server_commit")
