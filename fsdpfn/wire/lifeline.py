"""A run's processes die with their launcher: the contract between the launcher and every process
it starts (trainer ranks, the rollout server, reward workers), kept here because both sides of the
run speak it and the rollout server imports nothing of the application.

The launcher starts the trainer ranks and the rollout server with ``die_with_parent()`` as
preexec_fn: on Linux the kernel sends them SIGKILL when the launcher dies, even by SIGKILL. Each
rank also runs ``watch_launcher()`` (a rank started another way, under torchrun, is not the
launcher's child): a daemon thread that exits the process within about a second of the
launcher's pid going away (the pid comes in the environment as FSDPFN_LAUNCHER_PID; the server
takes ``--parent-pid``).
Processes that a rank starts itself (the reward workers) call ``exit_with_parent()`` first thing:
the same kernel signal, set by the child (no ``preexec_fn`` in a threaded parent), and a watch of
its own; so a worker dies with rank 0 even in the middle of a call that never returns.

A long-running process of the run (a trainer rank at its loop's start, the rollout server once
its model is loaded) also tells its garbage collector that what it has set up lives as long as
it does: ``freeze_long_lived()``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["LAUNCHER_PID_ENV", "die_with_parent", "watch_launcher", "watch_pid",
           "exit_with_parent", "pid_alive", "freeze_long_lived"]

LAUNCHER_PID_ENV = "FSDPFN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1



def process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a reused pid apart), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None  # field 22 of proc(5), after "pid (comm)"


def pid_alive(pid: int, start_time: str | None = None) -> bool:
    """Whether ``pid`` runs (a zombie does not); with ``start_time``, only the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return sys.platform != "linux"  # no /proc: trust kill(0)
    if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
        return False
    return start_time is None or process_start_time(pid) == start_time


def die_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` for subprocess.Popen: the child gets ``sig`` when the process that
    started it exits (Linux PR_SET_PDEATHSIG; a no-op elsewhere). Call it from the main thread:
    the kernel ties the signal to the thread that forked."""
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None

    def preexec() -> None:
        if libc is None:
            return
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)
    return preexec


def watch_pid(pid: int, on_gone, *, interval: float = 0.5, name: str = "fsdpfn-watchdog"):
    """Start a daemon thread that calls ``on_gone()`` once ``pid`` has exited."""
    start = process_start_time(pid)

    def loop() -> None:
        while pid_alive(pid, start):
            time.sleep(interval)
        on_gone()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def exit_with_parent(parent: int, *, kernel: bool = True, interval: float = 0.5) -> None:
    """Called by a child process itself: end it when ``parent`` (its parent's pid, handed over
    by the parent) exits. ``kernel``: PR_SET_PDEATHSIG SIGKILL too, which works even while the
    child's own code holds the GIL; pass it only when the parent started this process from its
    main thread, since the kernel sends the signal when the forking thread ends. A watchdog
    thread on the parent's pid covers the other case (and systems without prctl)."""
    if kernel and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # it died before this process could watch it
        os._exit(1)
    watch_pid(parent, lambda: os._exit(1), interval=interval, name="fsdpfn-parent-watch")


def watch_launcher(what: str, pid: int | None = None, *, interval: float = 0.5):
    """Exit this process (status 1, no cleanup: its launcher is gone and nothing supervises it)
    when the launcher exits. ``pid`` defaults to $FSDPFN_LAUNCHER_PID; None there: no watch."""
    if pid is None:
        value = os.environ.get(LAUNCHER_PID_ENV)
        if not value:
            return None
        pid = int(value)

    def gone() -> None:
        try:  # the output may be a pipe that the launcher read, broken now
            print(f"[fsdpfn] {what} (pid {os.getpid()}): its launcher (pid {pid}) is gone; "
                  f"exiting", file=sys.stderr, flush=True)
        finally:
            os._exit(1)
    return watch_pid(pid, gone, interval=interval)


def freeze_long_lived() -> None:
    """Collect once, then move every object alive now out of the garbage collector's reach
    (``gc.freeze``). After its setup, a trainer rank or the rollout server holds some 400,000
    objects (torch, transformers, its model and engine) that live until it ends, and every full
    collection walked them all: 0.27 to 0.52 s on a CPU core, during which the process, its
    other threads and the ranks waiting on it in a collective stood still. Objects made later
    are collected as before, and reference counting still frees frozen ones; only a frozen
    reference cycle that becomes garbage later stays, so call it where what is alive stays
    (after the setup, not inside a step). BENCHMARKS.md, "Garbage collection"."""
    gc.collect()
    gc.freeze()
