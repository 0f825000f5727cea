"""Reduce per-token values to a scalar loss, as a mean or as a (sum, normaliser) pair.

x[..., T] with mask[..., T] (bool): the last dim is tokens, every leading dim indexes sequences.
`aggregate_sum` returns a numerator and a normaliser (a count) that can be summed over
micro-batches and all-reduced over ranks before dividing, so a loss is independent of how rows are
split. Empty masks give 0, never nan: the division is by max(normaliser, 1).
"""

from __future__ import annotations

import torch

from fsdpfn.errors import BatchError, ConfigError

__all__ = ["aggregate", "aggregate_sum", "aggregate_sum_packed", "masked_values", "masked_max",
           "as_mask", "AGG_MODES"]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def check_mode(mode: str, name: str = "mode") -> None:
    """``mode`` is one of AGG_MODES; ``name``: the caller's parameter (a loss's ``agg``)."""
    if mode not in AGG_MODES:
        raise ConfigError(f"{name} must be one of {list(AGG_MODES)}, got {mode!r}")


def check_tensor(name: str, t) -> None:
    """``t`` is a torch.Tensor, else a BatchError naming it and what came instead."""
    if not isinstance(t, torch.Tensor):
        raise BatchError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")


def check_same_shape(like_name: str, like: torch.Tensor, *, optional: tuple = (),
                     **tensors) -> None:
    """``like`` and each tensor of ``tensors`` are torch.Tensors, each with the shape and on the
    device of ``like`` (a name in ``optional`` may be None: absent), else a BatchError naming
    it and both shapes or devices."""
    check_tensor(like_name, like)
    for name, t in tensors.items():
        if t is None and name in optional:
            continue
        check_tensor(name, t)
        if t.shape != like.shape:
            raise BatchError(f"{name} must have the shape of {like_name} {tuple(like.shape)}, "
                             f"got {tuple(t.shape)}")
        if t.device != like.device:
            raise BatchError(f"{name} must be on the device of {like_name} ({like.device}), "
                             f"got {t.device}")


def as_mask(mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """``mask`` as bool: a bool tensor as it is, another dtype only where every entry is 0 or 1;
    a weight such as 0.5 (or -1) would otherwise count as True, and a weighted mean was meant."""
    if mask.dtype == torch.bool:
        return mask
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        index = [int(i) for i in bad.nonzero()[0]]
        raise BatchError(f"{name}: must be bool or hold only 0 and 1 (a mask, not weights: "
                         f"weight the values instead), got {mask[tuple(index)].item()!r} at "
                         f"index {index} ({mask.dtype})")
    return mask.bool()


def masked_values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float32 x with exact zeros under a False mask (where, not multiply: nan/inf there don't leak)."""
    check_same_shape("x", x, mask=mask)
    x = x.float()
    return torch.where(as_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The largest entry of ``x`` under a True mask, a detached float32 0-d tensor; 0 when the
    mask holds none (a statistic of a micro-batch without loss tokens)."""
    mask = as_mask(mask)
    if not bool(mask.any()):
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.where(mask, x.detach().float(), float("-inf")).max()


def _rows_sum(xm: torch.Tensor, m: torch.Tensor, mode: str):
    """Row sums and counts -> (numerator, normaliser) for the seq-mean modes."""
    row_sum, row_cnt = xm.sum(-1), m.sum(-1).float()
    valid = row_cnt > 0
    if mode == "seq-mean-token-mean":
        row_sum = row_sum / row_cnt.clamp(min=1.0)
    num = torch.where(valid, row_sum, torch.zeros_like(row_sum)).sum()
    return num, valid.sum().float()


def aggregate_sum(x: torch.Tensor, mask: torch.Tensor, mode: str):
    """(numerator, normaliser) with aggregate = numerator / max(normaliser, 1); both 0-dim float32.

    token-mean: (sum mask*x, sum mask); seq-mean-token-sum: (sum over rows of sum_t mask*x, number
    of rows with >= 1 True); seq-mean-token-mean: (sum over such rows of their token mean, that
    number of rows).
    """
    check_mode(mode)
    check_same_shape("x", x, mask=mask)
    if x.dim() < 1:
        raise BatchError("x must have a token dim [..., T], got a 0-dim tensor")
    m = as_mask(mask)
    xm = masked_values(x, m)
    if mode == "token-mean":
        return xm.sum(), m.sum().float()
    return _rows_sum(xm.reshape(-1, xm.shape[-1]), m.reshape(-1, m.shape[-1]), mode)


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """x[..., T], mask[..., T] -> 0-dim float32; 0 when nothing is masked in."""
    num, den = aggregate_sum(x, mask, mode)
    return num / den.clamp(min=1.0)


def aggregate_sum_packed(x: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str):
    """`aggregate_sum` on a packed stream: x[N], mask[N], sequence i = tokens cu_seqlens[i]:cu_seqlens[i+1].

    cu_seqlens[S+1] int, starts at 0, non-decreasing, ends at N.
    """
    check_mode(mode)
    if x.dim() != 1:
        raise BatchError(f"x must be a flat token stream [N], got shape {tuple(x.shape)}")
    m = as_mask(mask)
    xm = masked_values(x, m)
    if mode == "token-mean":
        return xm.sum(), m.sum().float()
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    lengths = cu.diff()
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != x.shape[0] \
            or bool((lengths < 0).any()):
        raise BatchError(f"cu_seqlens must be non-decreasing from 0 to N = {x.shape[0]}, "
                         f"got {cu_seqlens.tolist()}")
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths)  # (N,)
    row_sum = xm.new_zeros(lengths.numel()).index_add(0, seq, xm)
    row_cnt = xm.new_zeros(lengths.numel()).index_add(0, seq, m.float())
    valid = row_cnt > 0
    if mode == "seq-mean-token-mean":
        row_sum = row_sum / row_cnt.clamp(min=1.0)
    return torch.where(valid, row_sum, torch.zeros_like(row_sum)).sum(), valid.sum().float()
