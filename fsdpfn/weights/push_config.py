"""PushConfig: every option of a RolloutTarget push but the servers' urls, as one frozen,
validated value (``RolloutTarget(urls, config=PushConfig(...))``).

Each field is checked when the value is built; a bad one raises ConfigError naming the field, the
rule and the value (``timeout_s: must be a number > 0, got 0.0``).
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any, Callable, Literal

import attrs

from fsdpfn.errors import ConfigError
from fsdpfn.wire.protocol import DEFAULT_BUCKET_BYTES, DEFAULT_EDGE_BYTES

__all__ = ["PushConfig", "Transport", "TRANSPORTS", "BACKENDS", "PAUSE_MODES"]

# how the bytes travel: a process group shared with the servers, files under disk_root that the
# servers read, or CUDA IPC handles (servers on trainer rank 0's own GPU)
Transport = Literal["broadcast", "disk", "ipc"]
TRANSPORTS: tuple[str, ...] = typing.get_args(Transport)
BACKENDS = (None, "gloo", "nccl")
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes


def _fail(field: str, rule: str, value: Any):
    raise ConfigError(f"{field}: {rule}, got {value!r}")


def _transport(_, attribute, value) -> None:
    if value not in TRANSPORTS:
        _fail(attribute.name, "must be 'broadcast', 'disk' or 'ipc'", value)


def _backend(_, attribute, value) -> None:
    if value not in BACKENDS:
        _fail(attribute.name, "must be None, 'gloo' or 'nccl'", value)


def _pause_mode(_, attribute, value) -> None:
    if value not in PAUSE_MODES:
        _fail(attribute.name, f"must be one of {PAUSE_MODES} (SGLang's /pause_generation modes)",
              value)


def _dtype(_, attribute, value) -> None:
    if value is None:
        return
    from fsdpfn.wire.protocol import dtype_from_name

    try:
        dtype_from_name(value)
    except ValueError as exc:
        raise ConfigError(f"{attribute.name}: {exc}") from None


def _positive_seconds(_, attribute, value) -> None:
    if not isinstance(value, (int, float)) or not value > 0:
        _fail(attribute.name, "must be a number > 0", value)


def _int_at_least_1(*, optional: bool = False):
    def check(_, attribute, value) -> None:
        if optional and value is None:
            return
        if not isinstance(value, int) or value < 1:
            _fail(attribute.name, f"must be {'None or ' if optional else ''}an int >= 1", value)
    return check


def _probe_tol(_, attribute, value) -> None:
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                              or not value >= 0):
        _fail(attribute.name, "must be None or a number >= 0", value)


def _to_float(value):
    # ints are accepted where seconds are meant; anything else is left to the validator
    return float(value) if isinstance(value, (int, float)) else value


def _path(_, attribute, value) -> None:
    if value is not None and not isinstance(value, Path):
        _fail(attribute.name, "must be None or a directory path (str or os.PathLike)", value)


def _to_path(value):
    return Path(value) if isinstance(value, (str, os.PathLike)) else value


@attrs.frozen
class PushConfig:
    """How a RolloutTarget pushes (the transports: fsdpfn.weights.push).

    transport: "broadcast" (over the update channel to fsdpfn.rollout servers that offer one,
    else in SGLang's protocol), "disk" (needs ``disk_root``, shared with the servers) or "ipc"
    (servers on trainer rank 0's GPU: CUDA IPC handles to device buffers, see
    fsdpfn.weights.ipc).
    dtype: the dtype sent (None: the servers' served dtype).
    backend: "gloo" or "nccl" (None: nccl when the trainer and every server are on CUDA).
    timeout_s: bound on every HTTP request and every bucket's transfer; init_timeout_s on
    creating the group. pause_generation: pause around the swap. flush_cache: ask the servers to
    drop their KV cache with the update. precheck: compare names and shapes with each server's
    before sending. disk_root / keep_last: where transport="disk" publishes versions and how many
    it keeps. master_address / master_port: where the servers reach trainer rank 0's store
    (None: 127.0.0.1 for local servers, else the address of the interface that routes to the
    first server; a free port). group_name: the update group's name (None: a fresh
    ``fsdpfn-<hex>`` per RolloutTarget). on_bucket(index, n_buckets): called on rank 0 once each
    bucket is on the wire (progress reports). bucket_bytes / edge_bucket_bytes: the size of the
    middle buckets and of the first and last ones (None: no ramp). pause_generation applies to
    SGLang's protocol, IPC and disk (over the update channel the server swaps between two decode
    steps without a pause). pause_mode: SGLang's /pause_generation mode ("abort",
    "retract", "in_place"). probe_tol: after a push to SGLang, the largest gap allowed between
    the server's greedy log-probs on a fixed prompt and the trainer's forward_logp (None: 1e-3
    for a float32 push, 0.1 for 16-bit dtypes).
    """

    transport: Transport = attrs.field(default="broadcast", validator=_transport)
    dtype: str | None = attrs.field(default=None, validator=_dtype)
    bucket_bytes: int = attrs.field(default=DEFAULT_BUCKET_BYTES, validator=_int_at_least_1())
    backend: str | None = attrs.field(default=None, validator=_backend)
    timeout_s: float = attrs.field(default=300.0, converter=_to_float,
                                   validator=_positive_seconds)
    init_timeout_s: float = attrs.field(default=120.0, converter=_to_float,
                                        validator=_positive_seconds)
    pause_generation: bool = True
    flush_cache: bool = True
    precheck: bool = True
    disk_root: Path | None = attrs.field(default=None, converter=_to_path, validator=_path)
    keep_last: int = attrs.field(default=2, validator=_int_at_least_1())
    master_address: str | None = None
    master_port: int | None = None
    group_name: str | None = None
    on_bucket: Callable[[int, int], None] | None = None
    edge_bucket_bytes: int | None = attrs.field(default=DEFAULT_EDGE_BYTES,
                                                validator=_int_at_least_1(optional=True))
    pause_mode: str = attrs.field(default="abort", validator=_pause_mode)
    probe_tol: float | None = attrs.field(default=None, validator=_probe_tol)

    def __attrs_post_init__(self):
        if self.transport == "disk" and self.disk_root is None:
            raise ConfigError("disk_root: must be set for transport='disk' (a directory the "
                              "servers can read at the same path), got None")
