"""Rank-symmetric assertions: every rank learns the verdict, so one failing rank never hangs others."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["assert_all_ranks", "assert_close_all_ranks"]


def assert_all_ranks(ok: bool, message: str = "", *, group=None) -> None:
    """Raise AssertionError on every rank when ``ok`` is False on any rank (with each message)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    if int(flag.item()) == 0:
        return
    messages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if ok else message, group=group)
    detail = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
    raise AssertionError(f"{int(flag.item())} rank(s) failed: {detail}")


def assert_close_all_ranks(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float,
                           atol: float, what: str = "tensor", group=None) -> None:
    """torch.testing.assert_close, but agreed over all ranks."""
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        ok, message = True, ""
    except AssertionError as exc:
        ok, message = False, f"{what}: {exc}"
    assert_all_ranks(ok, message, group=group)
