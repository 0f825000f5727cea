"""DCP's options and errors, and the collective helpers every checkpoint stage shares (see
fsdpfn.checkpoint)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions

from fsdpfn.agree import world_size
from fsdpfn.errors import CheckpointError

OPTIM_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
DCP_ERRORS = (Exception, CheckpointException)  # DCP's own exception derives from BaseException


def from_rank_zero(value):
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:3])[:600]}"


def as_checkpoint_error(fn: str, what: str, exc: BaseException) -> CheckpointError:
    """A CheckpointError from any exception, DCP's CheckpointException (a BaseException holding
    each failing rank's exception) included."""
    failures = getattr(exc, "failures", None) if isinstance(exc, CheckpointException) else None
    if isinstance(failures, dict) and failures:
        named = [f[0] for _, f in sorted(failures.items()) if isinstance(f[0], CheckpointError)]
        if named:  # fsdpfn's own verdict from inside DCP (a file named): pass it on as it is
            return CheckpointError(str(named[0]))
        detail = "; ".join(f"rank {rank}: {_one_line(failure[0])}"
                           for rank, failure in sorted(failures.items())[:4])
    else:
        detail = _one_line(exc)
    return CheckpointError(f"{fn}: {what}: failed ({detail})")
