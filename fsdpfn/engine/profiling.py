"""fsdpfn.profile (defined here: a module named ``profile`` would shadow the function on the
package once imported): torch.profiler traces (Chrome / Perfetto JSON) of chosen training steps.

    with ff.profile("traces/", steps=[3, 4], memory=True):
        for i in range(10):
            batch = ff.forward_logp(actor, batch, out_key="old_logp")
            actor, stats = ff.ppo_step(actor, batch, ff.PPOConfig())

Steps are the training calls (grad_step and every ``*_step`` built on it) made inside the block,
counted from 0. The trace of step k covers everything from the end of step k-1 (or the start of
the block) to the end of step k, so the forward_logp calls and the weight push of an RL iteration
are in it. Each rank writes ``<dir>/step<k>_rank<r>.json``; with ``steps=None`` the whole block
is one trace, ``<dir>/trace_rank<r>.json``. Open them at https://ui.perfetto.dev or
chrome://tracing. Inside, fsdpfn's ranges are named ``fsdpfn.<function>`` (``fsdpfn.ppo_step``,
``fsdpfn.forward_logp``, ``fsdpfn.push_weights``) and, within them, ``fsdpfn.<stage>`` (plan,
forward, backward, optimizer, comm; gather in a push) as in ``fsdpfn.engine.timing``.

``memory=True`` also records allocations in the trace (profile_memory) and, on CUDA, writes the
allocator's snapshot of the traced step, ``step<k>_rank<r>.memory.pickle``: drag it into
https://pytorch.org/memory_viz. A step still open when the block ends (an exception, or fewer
steps than asked) is dropped, not written.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterable

import torch

from fsdpfn.errors import ConfigError
from fsdpfn.validators import check_dir
from fsdpfn.agree import rank
from fsdpfn.engine.timing import PROFILER

__all__ = ["profile", "ProfileSession"]

_MEMORY_ENTRIES = 100_000  # allocator events kept for a snapshot


class ProfileSession:
    """The state of one ``profile`` block: which training step comes next and the trace (if
    any) being recorded. Internal: the engine calls after_call."""

    def __init__(self, out_dir: Path, steps: frozenset[int] | None, *, memory: bool,
                 record_shapes: bool, with_stack: bool):
        self.out_dir = out_dir
        self.steps = steps
        self.memory = memory
        self.options = dict(record_shapes=record_shapes, with_stack=with_stack,
                            profile_memory=memory)
        self.step = 0  # training calls finished inside the block
        self.written: list[Path] = []
        self._prof = None
        self._cuda = torch.cuda.is_available()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory and self._cuda:
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_ENTRIES)  # noqa: SLF001
        try:
            prof = torch.profiler.profile(activities=activities, **self.options)
            prof.__enter__()
        except BaseException:
            if self.memory and self._cuda:
                torch.cuda.memory._record_memory_history(enabled=None)  # noqa: SLF001
            raise
        self._prof = prof  # only a started profiler is one to stop

    def _stop(self, stem: str | None) -> None:
        """Stop the running trace; write it under ``stem`` (None: drop it)."""
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        if stem is not None:
            path = self.out_dir / f"{stem}_rank{rank()}.json"
            prof.export_chrome_trace(str(path))
            self.written.append(path)
        if self.memory and self._cuda:
            if stem is not None:
                path = self.out_dir / f"{stem}_rank{rank()}.memory.pickle"
                torch.cuda.memory._dump_snapshot(str(path))  # noqa: SLF001
                self.written.append(path)
            torch.cuda.memory._record_memory_history(enabled=None)  # noqa: SLF001

    def open(self) -> None:
        if self.steps is None or 0 in self.steps:
            self._start()

    def after_call(self, name: str, *, step: bool) -> None:
        """A training step ended: write its trace, start the next chosen one."""
        if not step or self.steps is None:
            return
        if self._prof is not None:
            self._stop(f"step{self.step}")
        self.step += 1
        if self.step in self.steps:
            self._start()

    def close(self, ok: bool) -> None:
        if self._prof is not None:
            self._stop("trace" if self.steps is None and ok else None)


def _check_steps(steps) -> frozenset[int] | None:
    if steps is None:
        return None
    if isinstance(steps, (str, bytes)):  # iterable, but of characters
        raise ConfigError(f"steps: must be an iterable of step indices (ints >= 0) or None, "
                          f"got {steps!r}")
    try:
        chosen = frozenset(steps)
    except TypeError:
        raise ConfigError(f"steps: must be an iterable of step indices (ints >= 0) or None, "
                          f"got {steps!r}") from None
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in chosen):
        raise ConfigError(f"steps: must hold ints >= 0 (training calls inside the block, "
                          f"counted from 0), got {sorted(chosen, key=repr)!r}")
    return chosen


@contextlib.contextmanager
def profile(out_dir: str | os.PathLike, *, steps: Iterable[int] | None = None,
            memory: bool = False, record_shapes: bool = False, with_stack: bool = False):
    """Trace the chosen training steps of the block (all of it with ``steps=None``) into
    Chrome/Perfetto JSON files under ``out_dir``, one per step and rank; see the module
    docstring. Yields the session; its ``written`` lists the files written so far. Every rank
    enters the block (each writes its own files); not re-entrant."""
    out = check_dir("out_dir", out_dir)
    steps = _check_steps(steps)
    for name, value in (("memory", memory), ("record_shapes", record_shapes),
                        ("with_stack", with_stack)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: must be a bool, got {value!r}")
    if PROFILER.get() is not None:
        raise ConfigError("profile: already inside an fsdpfn.profile block (one torch profiler "
                          "at a time), got a nested one")
    out.mkdir(parents=True, exist_ok=True)
    session = ProfileSession(out, steps, memory=memory, record_shapes=record_shapes,
                             with_stack=with_stack)
    token = PROFILER.set(session)
    ok = False
    try:
        session.open()  # inside: a profiler that fails to start leaves no session behind
        yield session
        ok = True
    finally:
        PROFILER.reset(token)
        session.close(ok)
