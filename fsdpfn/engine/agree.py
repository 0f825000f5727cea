"""Helpers through which every rank agrees on one outcome, so one failing rank never leaves the
others waiting in a collective.

agree_on_error           every rank of the job raises if any rank has an error
agree_on_error_in_group  the same over one process group (e.g. an async save's own group)
is_rank_zero             the rank that talks to the outside (receivers, servers) for the job
rank, world_size         this process's rank and the job's size (0 and 1 without a process group)
capture_error            run a step on rank 0 and keep its failure as a typed error to agree on
share_from_rank_zero     rank 0's value (or error) on every rank, in one collective
require_loss_tokens      a BatchError on every dp rank when the global batch has no loss token
same_on_every_rank       a call's arguments (config fields, batch keys, a path) equal on every rank
given_path               a path argument as given, for same_on_every_rank
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

import attrs
import torch
import torch.distributed as dist

from fsdpfn.errors import BatchError, ConfigError, WeightSyncError

if TYPE_CHECKING:
    from fsdpfn.engine.mesh import Mesh

__all__ = ["agree_on_error", "agree_on_error_in_group", "is_rank_zero", "rank", "world_size",
           "capture_error", "share_from_rank_zero", "require_loss_tokens", "same_on_every_rank",
           "given_path"]


def agree_on_error(mesh: Mesh | None, exc: BaseException | None) -> None:
    """Collective verdict: if any rank has an error, every rank raises (no rank is left waiting).

    Ranks with their own error raise it; the others raise the same type naming the failing rank.
    With ``mesh`` None the verdict is local (``exc`` is raised if given)."""
    if mesh is None:
        _raise_local(exc)
        return
    agree_on_error_in_group(None, exc)


def agree_on_error_in_group(group, exc: BaseException | None, *,
                            error_type: type[BaseException] | None = None) -> None:
    """agree_on_error over ``group`` (None: the default group, every rank of the job). Ranks
    without an error raise ``error_type`` (default: the failing rank's own type) naming the
    failing rank and its message."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        _raise_local(exc)
        return
    flag = torch.tensor([0 if exc is None else 1], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return
    payload = None if exc is None else (type(exc), str(exc))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    if exc is not None:
        raise exc
    rank, (etype, message) = next((r, p) for r, p in enumerate(gathered) if p is not None)
    raise (error_type or etype)(f"(raised on rank {rank}) {message}")


def require_loss_tokens(mesh: Mesh | None, loss_mask: torch.Tensor) -> None:
    """BatchError on every data-parallel rank when the global batch (every dp rank's part of it)
    has no loss token. A rank's own part may have none: shard_batch can place only untrained
    rows on one rank, and the losses are normalised over the global batch. Every rank of the
    dp group must call it (an all-reduce of one count)."""
    count = torch.tensor([int(loss_mask.sum()), loss_mask.shape[0]], dtype=torch.int64)
    if mesh is not None and mesh.dp > 1:
        dist.all_reduce(count, group=mesh.group("dp"))
    tokens, rows = (int(c) for c in count)
    if tokens == 0:
        where = (f"on any of the {mesh.dp} data-parallel ranks" if mesh is not None and mesh.dp > 1
                 else "in the batch")
        raise BatchError(f"loss_mask: must have at least one True, got none {where} (all {rows} "
                         f"rows are all False; nothing would be trained on)")


def same_on_every_rank(fn_name: str, values: Mapping[str, Any], *,
                       error_type: type[Exception] = ConfigError, group=None,
                       batch_names: tuple[str, ...] = ()) -> None:
    """``error_type`` on every rank of ``group`` (None: the job) when some of ``values`` (name ->
    value, compared by repr) differ between its ranks, naming each and its value on every rank;
    BatchError when one of them is among ``batch_names`` (what the batch holds, not an option).

    SPMD: every rank runs the same call. A call whose options differ by rank would run different
    collectives (another minibatch count, another set of stats) and leave ranks waiting on each
    other; this turns that into one clear error. The names must be the same on every rank (the
    caller's code, not its data); the check is one all-reduce of two int64 a value."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not values:
        return
    names = list(values)
    prints = [zlib.crc32(_stable_repr(values[name]).encode()) for name in names]
    both = torch.tensor(prints + [-p for p in prints], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = len(names)
    differ = [names[i] for i in range(n) if int(both[i]) != -int(both[n + i])]
    if not differ:
        return
    shown: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(shown, {name: _shorten(_stable_repr(values[name]))
                                   for name in differ}, group=group)
    detail = "; ".join(f"{name}: " + ", ".join(f"{value[name]} on rank {r}"
                                               for r, value in enumerate(shown))
                       for name in differ)
    if any(name in batch_names for name in differ):
        error_type = BatchError
    raise error_type(f"{fn_name}: every rank must make the same call (SPMD), got different "
                     f"{', '.join(differ)} on the ranks: {detail}")


def given_path(path: Any) -> str:
    """A path argument as the caller gave it (not resolved: nodes may differ in their working
    directory or home), for same_on_every_rank."""
    return os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)


def _stable_repr(value: Any) -> str:
    """A repr equal on every rank for equal settings: sets in sorted order (their iteration
    order follows each process's hash seed), a device by its type (each rank has its own
    cuda:N), a tensor by dtype and shape, attrs classes field by field, no object addresses."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, torch.device):
        return f"device({value.type!r})"
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, {tuple(value.shape)})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_stable_repr(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_stable_repr(k)}: {_stable_repr(v)}"
                               for k, v in value.items()) + "}"
    if attrs.has(type(value)):  # fields left out of equality (eq=False) are not settings
        return type(value).__name__ + "(" + ", ".join(
            f"{f.name}={_stable_repr(getattr(value, f.name))}"
            for f in attrs.fields(type(value)) if f.eq) + ")"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__name__ + "(" + ", ".join(
            f"{f.name}={_stable_repr(getattr(value, f.name))}"
            for f in dataclasses.fields(value) if f.compare) + ")"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _raise_local(exc: BaseException | None) -> None:
    if exc is not None:
        raise exc


def rank() -> int:
    """This process's rank in the default group; 0 in a job without one."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks of the default group; 1 in a job without one."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank_zero() -> bool:
    """Rank 0 of the default group (or a job without one) talks to the outside; the others
    only take part in the collectives."""
    return rank() == 0


def capture_error(fn: Callable[[], Any], what: str, *,
                  caller: str = "push_weights") -> tuple[Any, WeightSyncError | None]:
    """``(fn(), None)``, or ``(None, error)`` when ``fn`` fails: a WeightSyncError as raised,
    anything else wrapped in one naming ``caller`` and ``what`` (a bug or I/O error on rank 0
    must become a verdict the other ranks learn, never a hang)."""
    try:
        return fn(), None
    except WeightSyncError as exc:
        return None, exc
    except Exception as exc:  # noqa: BLE001 - handed to the verdict
        return None, WeightSyncError(f"{caller}: {what} failed on trainer rank 0: "
                                     f"{type(exc).__name__}: {exc}")


def share_from_rank_zero(value: Any, error: WeightSyncError | None) -> Any:
    """Rank 0's (value, error) on every rank (one collective); returns the value, or raises a
    WeightSyncError on every rank when rank 0 has an error. Other ranks pass (None, None)."""
    if world_size() > 1:
        box = [value, None if error is None else str(error)]
        dist.broadcast_object_list(box, src=0)
        value, message = box
        if message is not None:
            raise error if error is not None else WeightSyncError(
                f"(raised on rank 0) {message}")
    elif error is not None:
        raise error
    return value
