"""The trainer ranks of ``fsdpfn run``, started by the launcher itself: one process per rank,
with the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the rendezvous store), their output on
one pipe.

Why not torchrun: a run of ``fsdpfn run`` is one host and a fixed number of ranks, so torchrun's
elastic agent (restarts, rendezvous across hosts) has nothing to do, and it is one more process
that imports torch before any rank starts: 1.5-2.5 s of every start on a small CPU host
(BENCHMARKS.md, "Start-up of fsdpfn run"). Its one duty here stays: when a rank fails, the
others are stopped (they would wait in a collective for it), SIGTERM first and SIGKILL
``grace`` seconds later.

Each rank runs in a session of its own (a terminal's Ctrl-C reaches the launcher alone, which
forwards it: fsdpfn/app/terminal.py) and gets a parent-death SIGKILL (fsdpfn.wire.lifeline):
the ranks are the launcher's children, so they die with it even when it is killed by SIGKILL.

Only the standard library is imported here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

__all__ = ["TrainerRanks", "rank_env", "describe_status"]


def rank_env(rank: int, nproc: int, port: int, addr: str = "127.0.0.1") -> dict[str, str]:
    """The variables torch.distributed's ``env://`` rendezvous and the ranks read."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": addr,
            "MASTER_PORT": str(port)}


def describe_status(code: int) -> str:
    """A process's exit as a phrase: "exited with status 1", "was killed by SIGKILL"."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


class TrainerRanks:
    """``nproc`` processes running ``cmd``, rank ``i`` with ``rank_env(i, ...)`` over ``env``.

    ``stdout``: one pipe with every rank's stdout and stderr, at end of file once every rank
    (and whatever it started that holds the pipe) has exited. ``poll()``/``wait()`` as
    subprocess.Popen's, for the group: the status is 0 when every rank exited 0, else the first
    failed rank's (``failed``: (rank, its return code); a rank killed by a signal gives 128 +
    the signal, as a shell does). A failed rank stops the others (``stop``; ``stopped``: ranks
    were still running when one failed and were stopped)."""

    def __init__(self, cmd: list[str], nproc: int, *, port: int, env: dict[str, str],
                 grace: float = 5.0, preexec_fn=None):
        self.grace = float(grace)
        self.failed: tuple[int, int] | None = None
        self.stopped = False
        self._kill_at: float | None = None
        self.procs: list[subprocess.Popen] = []
        read, write = os.pipe()
        try:
            for rank in range(nproc):
                self.procs.append(subprocess.Popen(
                    cmd, env={**env, **rank_env(rank, nproc, port)}, stdin=subprocess.DEVNULL,
                    stdout=write, stderr=write, start_new_session=True, preexec_fn=preexec_fn))
        except BaseException:
            self.kill()
            os.close(read)
            raise
        finally:
            os.close(write)
        self.stdout = os.fdopen(read, "rb", buffering=0)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def running(self) -> bool:
        """Whether any rank still runs (no side effects: safe in a signal handler)."""
        return any(p.poll() is None for p in self.procs)

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0) and self.failed is None:
                self.failed = (rank, code)
        alive = any(code is None for code in codes)
        if alive:
            if self.failed is not None and self._kill_at is None:
                self.stopped = True
                self.stop()
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self.kill()
            return None
        if self.failed is None:
            return 0
        code = self.failed[1]
        return 128 - code if code < 0 else code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.procs[0].args, timeout)
            time.sleep(0.05)
        return code

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM to every running rank (a rank past its start-up finishes its step and exits;
        one still starting exits at once), SIGKILL ``grace`` seconds later (by ``poll``)."""
        self.signal(signal.SIGTERM)
        when = time.monotonic() + (self.grace if grace is None else grace)
        self._kill_at = when if self._kill_at is None else min(self._kill_at, when)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def describe_failure(self) -> str | None:
        """"trainer rank 1 was killed by SIGKILL", or None when no rank failed."""
        if self.failed is None:
            return None
        rank, code = self.failed
        return f"trainer rank {rank} {describe_status(code)}"
