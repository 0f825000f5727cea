"""PushConfig: every option of a RolloutTarget push but the servers' urls, as one frozen,
validated value (``RolloutTarget(urls, config=PushConfig(...))``).

Each field is checked when the value is built; a bad one raises ConfigError naming the field, the
rule and the value (``timeout_s: must be a number > 0, got 0.0``).
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Callable, Literal

import attrs

from fsdpfn.errors import ConfigError
from fsdpfn.validators import boolean, int_to_float, is_port, one_of, satisfies, to_path
from fsdpfn.wire.protocol import DEFAULT_BUCKET_BYTES, DEFAULT_EDGE_BYTES

__all__ = ["PushConfig", "Transport", "TRANSPORTS", "BACKENDS", "PAUSE_MODES"]

# how the bytes travel: a process group shared with the servers, files under disk_root that the
# servers read, or CUDA IPC handles (servers on trainer rank 0's own GPU)
Transport = Literal["broadcast", "disk", "ipc"]
TRANSPORTS: tuple[str, ...] = typing.get_args(Transport)
BACKENDS = (None, "gloo", "nccl")
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes


_transport = one_of(*TRANSPORTS, rule="must be 'broadcast', 'disk' or 'ipc'")
_backend = one_of(*BACKENDS, rule="must be None, 'gloo' or 'nccl'")
_pause_mode = one_of(*PAUSE_MODES,
                     rule=f"must be one of {PAUSE_MODES} (SGLang's /pause_generation modes)")


def _dtype(_, attribute, value) -> None:
    if value is None:
        return
    from fsdpfn.wire.protocol import dtype_from_name

    try:
        dtype_from_name(value)
    except ValueError as exc:
        raise ConfigError(f"{attribute.name}: {exc}") from None


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least_1(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


_positive_seconds = satisfies("must be a number > 0", lambda v: _real(v) and v > 0)
_count = satisfies("must be an int >= 1", _int_at_least_1)
_opt_count = satisfies("must be None or an int >= 1", _int_at_least_1, optional=True)
_probe_tol = satisfies("must be None or a number >= 0",
                       lambda v: _real(v) and v >= 0, optional=True)
_port = satisfies("must be None or a port number in 0..65535 (None or 0: a free port)",
                  is_port, optional=True)
_path = satisfies("must be None or a directory path (str or os.PathLike)",
                  lambda v: isinstance(v, Path), optional=True)
_host = satisfies("must be None or a host name or address (a non-empty string)",
                  lambda v: isinstance(v, str) and v.strip() != "", optional=True)
_group = satisfies("must be None or a non-empty string without whitespace (None: a fresh "
                   "fsdpfn-<hex> per RolloutTarget)",
                   lambda v: isinstance(v, str) and v != "" and not any(c.isspace() for c in v),
                   optional=True)
_callback = satisfies("must be None or a callable (index, n_buckets)", callable, optional=True,
                      show=lambda v: repr(v)[:80])


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
    drop their KV cache with the update. precheck: compare names and shapes with each server's,
    and the model's config (fsdpfn.wire.model_fingerprint) with a server that reports one,
    before sending. disk_root / keep_last: where transport="disk" publishes versions and how many
    it keeps. master_address / master_port: where the servers reach trainer rank 0's store
    (None: 127.0.0.1 for local servers, else the address of the interface that routes to the
    first server; 0 or None: a free port). group_name: the update group's name (None: a fresh
    ``fsdpfn-<hex>`` per RolloutTarget). on_bucket(index, n_buckets): called on rank 0 once each
    bucket is on the wire (progress reports), over the update channel and SGLang's protocol; a
    disk or IPC push, handed over whole, never calls it. bucket_bytes / edge_bucket_bytes: the
    size of the middle buckets and of the first and last ones (None: no ramp).
    pause_generation applies to SGLang's protocol, IPC and disk (over the update channel the
    server swaps between two decode steps without a pause). pause_mode: SGLang's
    /pause_generation mode ("abort", "retract", "in_place"). probe_tol: after a push to SGLang,
    the largest gap allowed between the server's greedy log-probs on a fixed prompt and the
    trainer's forward_logp (None: 1e-3 for a float32 push, 0.1 for 16-bit dtypes).
    """

    transport: Transport = attrs.field(default="broadcast", validator=_transport)
    dtype: str | None = attrs.field(default=None, validator=_dtype)
    bucket_bytes: int = attrs.field(default=DEFAULT_BUCKET_BYTES, validator=_count)
    backend: str | None = attrs.field(default=None, validator=_backend)
    timeout_s: float = attrs.field(default=300.0, converter=int_to_float,
                                   validator=_positive_seconds)
    init_timeout_s: float = attrs.field(default=120.0, converter=int_to_float,
                                        validator=_positive_seconds)
    pause_generation: bool = attrs.field(default=True, validator=boolean)
    flush_cache: bool = attrs.field(default=True, validator=boolean)
    precheck: bool = attrs.field(default=True, validator=boolean)
    disk_root: Path | None = attrs.field(default=None, converter=to_path, validator=_path)
    keep_last: int = attrs.field(default=2, validator=_count)
    master_address: str | None = attrs.field(default=None, validator=_host)
    master_port: int | None = attrs.field(default=None, validator=_port)
    group_name: str | None = attrs.field(default=None, validator=_group)
    on_bucket: Callable[[int, int], None] | None = attrs.field(default=None,
                                                              validator=_callback)
    edge_bucket_bytes: int | None = attrs.field(default=DEFAULT_EDGE_BYTES,
                                                validator=_opt_count)
    pause_mode: str = attrs.field(default="abort", validator=_pause_mode)
    probe_tol: float | None = attrs.field(default=None, validator=_probe_tol)

    def __attrs_post_init__(self):
        if self.transport == "disk" and self.disk_root is None:
            raise ConfigError("disk_root: must be set for transport='disk' (a directory the "
                              "servers can read at the same path), got None")
