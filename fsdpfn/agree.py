"""Helpers through which every rank agrees on one outcome, so one failing rank never leaves the
others waiting in a collective. The one home of these helpers: the engine, the batch layer and
the trainer's wings all agree through them (they import only torch.distributed and
fsdpfn.errors).

verdict                  the primitive: any rank's error, or a value that differs by rank, seen
                         by every rank in one all-reduce of three int64
agree_on_error           every rank of the job raises if any rank has an error
agree_on_error_in_group  the same over one process group (e.g. an async save's own group)
same_on_every_rank       a call's arguments (config fields, batch keys, a path) equal on every rank
given_path               a path argument as given, for same_on_every_rank
require_loss_tokens      a BatchError on every dp rank when the global batch has no loss token
is_rank_zero             the rank that talks to the outside (receivers, servers) for the job
rank, world_size         this process's rank and the job's size (0 and 1 without a process group)
capture_error            run a step on rank 0 and keep its failure as a typed error to agree on
share_from_rank_zero     rank 0's value (or error) on every rank, in one collective
"""

from __future__ import annotations

import builtins
import dataclasses
import os
import re
import zlib
from typing import Any, Callable, Mapping

import attrs
import torch
import torch.distributed as dist

from fsdpfn import errors
from fsdpfn.errors import BatchError, ConfigError, WeightSyncError

__all__ = ["verdict", "agree_on_error", "agree_on_error_in_group", "is_rank_zero", "rank",
           "world_size", "capture_error", "share_from_rank_zero", "require_loss_tokens",
           "same_on_every_rank", "given_path"]


def verdict(error: BaseException | None, value: Any = None, *, group=None,
            error_type: type[BaseException] | None = None,
            foreign: Callable[[int, str, str], BaseException] | None = None) -> list | None:
    """Every rank's verdict on one call, over ``group`` (None: every rank of the job).

    Returns None when no rank has an error and ``value`` (compared by its stable repr) is the
    same on every rank: one all-reduce of three int64, the whole cost on the happy path.
    Otherwise every rank's report is gathered, and

    - a rank with an error raises its own;
    - the other ranks raise the first failing rank's error, "(raised on rank r) message", as
      ``error_type`` when given, else in that rank's type when it is one of fsdpfn's errors;
      ``foreign(rank, type name, message)`` builds any other, when given; else a builtin
      exception keeps its type, and any other type is a RuntimeError naming it;
    - when no rank has an error, every rank's ``value`` is returned in rank order, for the
      caller's own error naming what differs.

    Only the type's name travels, never the type (a class that does not pickle must not
    leave the other ranks waiting). Every rank of ``group`` must call it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        _raise_local(error)
        return None
    mark = zlib.crc32(_stable_repr(value).encode())
    vec = torch.tensor([error is not None, mark, -mark], dtype=torch.int64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    if int(vec[0]) == 0 and int(vec[1]) == -int(vec[2]):
        return None
    report = (value, None) if error is None else (None, (type(error).__module__,
                                                         type(error).__qualname__, str(error)))
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, report, group=group)
    _raise_local(error)
    failed = next(((r, e) for r, (_, e) in enumerate(every) if e is not None), None)
    if failed is not None:
        where, (module, name, message) = failed
        raise _remote_error(where, module, name, message, error_type, foreign)
    return [v for v, _ in every]


def _remote_error(where: int, module: str, name: str, message: str,
                  error_type: type[BaseException] | None,
                  foreign: Callable[[int, str, str], BaseException] | None) -> BaseException:
    """The error another rank raised, as this rank raises it."""
    etype = error_type or _error_type(errors if module == errors.__name__ else None, name)
    if etype is None and foreign is not None:
        return foreign(where, name, message)
    etype = etype or _error_type(builtins if module == "builtins" else None, name)
    try:  # a type whose constructor takes more than a message (UnicodeDecodeError) falls back
        if etype is not None:
            return etype(f"(raised on rank {where}) {message}")
    except TypeError:
        pass
    return RuntimeError(f"(raised on rank {where}) {name}: {message}")


def _error_type(module, name: str) -> type[BaseException] | None:
    value = getattr(module, name, None) if module is not None else None
    return value if isinstance(value, type) and issubclass(value, BaseException) else None


def agree_on_error(mesh, exc: BaseException | None) -> None:
    """Collective verdict: if any rank has an error, every rank raises (no rank is left waiting).

    Ranks with their own error raise it; the others raise it naming the failing rank, in its
    type when that is fsdpfn's or a builtin one, else as a RuntimeError naming the type
    (verdict). With ``mesh`` (a fsdpfn Mesh) None the verdict is local (``exc`` is raised if
    given)."""
    if mesh is None:
        _raise_local(exc)
        return
    verdict(exc)


def agree_on_error_in_group(group, exc: BaseException | None, *,
                            error_type: type[BaseException] | None = None) -> None:
    """agree_on_error over ``group`` (None: the default group, every rank of the job). Ranks
    without an error raise ``error_type`` (default: the failing rank's own type) naming the
    failing rank and its message."""
    verdict(exc, group=group, error_type=error_type)


def require_loss_tokens(mesh, loss_mask: torch.Tensor) -> None:
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
    caller's code, not its data); the check is one all-reduce of three int64 (verdict)."""
    if not values:
        return
    shown = {name: _stable_repr(value) for name, value in values.items()}
    every = verdict(None, shown, group=group)
    if every is None:
        return
    differ = [name for name in shown if len({value.get(name) for value in every}) > 1]
    detail = "; ".join(f"{name}: " + ", ".join(f"{_shorten(str(value.get(name)))} on rank {r}"
                                               for r, value in enumerate(every))
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
