"""run_spmd: run one function on N CPU ranks over gloo, with a timeout instead of a hang.

    def check(scale):                       # module level, so it can be pickled
        mesh = ff.build_mesh(ff.ParallelStrategy(dp=2))
        return mesh.rank("dp") * scale

    assert run_spmd(check, 2, args=(10,)) == [0, 10]

Every rank runs ``fn(*args)`` with the default process group initialised (gloo, world_size ranks).
The return values (picklable) come back in rank order. If any rank raises, SpmdError carries every
failing rank's traceback. If the ranks do not finish within ``timeout`` seconds, they are killed and
SpmdTimeout names the ranks still running, with the Python stack of every thread of each (a hang
shows where it waits: a collective, a join, a lock).

``SpmdPool`` keeps the ranks alive across calls (a test session saves the start-up of torch in every
process); a call that fails or times out tears the pool down, and the next call starts fresh ranks.
Every ``build_mesh`` makes process groups (up to four). Gloo gives each group a transport device
of its own by default, whose event-loop thread wakes on a short timeout even when the group is
idle; a rank here passes one shared device to all its groups instead, so leftover groups cost
memory and sockets but almost no CPU.
Groups cannot simply be destroyed after a call: DTensor caches sharding decisions by value, and a
new DeviceMesh equals an earlier one of the same layout, so a cached spec would name a destroyed
group. So a pool restarts its ranks after a call that leaves them more than ``max_groups`` groups.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

from fsdpfn.wire.ports import free_port

__all__ = ["run_spmd", "SpmdPool", "SpmdError", "SpmdTimeout"]


class SpmdError(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class SpmdTimeout(SpmdError):
    """The ranks did not finish in time (a hang, or a too-short timeout)."""


def _worker(rank: int, world_size: int, port: int, pg_timeout: float, conn,
            stacks: str | None = None) -> None:
    # environment of this child process only: threads per rank, no tokenizer parallelism
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if stacks is not None and hasattr(signal, "SIGUSR1"):
        import faulthandler

        # SIGUSR1 writes every thread's stack to this file: the parent asks before killing a
        # rank that did not finish in time
        faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"),  # noqa: SIM115
                              all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _share_one_gloo_device()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
    except BaseException:  # noqa: BLE001 - e.g. the port taken (EADDRINUSE): the parent reads it
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(*args, **kwargs)
            conn.send(("ok", (result, len(_groups()))))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()


def _share_one_gloo_device() -> None:
    """Every gloo group of this rank on one transport device instead of a device each.

    A device runs its own event-loop thread, which wakes on a short timeout whether or not the
    group is used: at 24 groups a 4-rank pool spent an eighth of a core doing nothing.
    Gloo's contexts can share a device (the options' device list), so the ranks pass one."""
    from torch.distributed import distributed_c10d as c10d

    gloo = c10d.ProcessGroupGloo
    device = gloo.create_default_device()

    class SharedDeviceGloo(gloo):
        def __init__(self, store, rank, size, timeout=datetime.timedelta(seconds=1800)):
            if isinstance(timeout, gloo._Options):
                super().__init__(store, rank, size, timeout)
                return
            options = gloo._Options()
            options._devices = [device]
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


def _groups() -> list:
    """This rank's process groups other than the default one."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return []
    registry = getattr(getattr(c10d, "_world", None), "pg_map", {})  # torch's own registry
    return [pg for pg in list(registry) if pg is not dist.group.WORLD]


class SpmdPool:
    """world_size long-lived CPU ranks over gloo. Use as a context manager or call close()."""

    def __init__(self, world_size: int, *, pg_timeout: float = 120.0, start_timeout: float = 120.0,
                 max_groups: int = 32):
        if world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {world_size}")
        self.world_size = world_size
        self.max_groups = max_groups
        self.restarts = 0  # times the ranks were restarted for their leftover groups
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self._procs: list = []
        self._conns: list = []
        self._stacks: list[str] = []  # each rank's stack file, in a folder of the pool's own

    def _start(self, attempts: int = 3) -> None:
        """Start the ranks. The port is free when chosen but can be taken before rank 0 binds
        it (by a process of another test choosing at the same moment): then the ranks, closed
        by the failure, start again on a fresh port."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except SpmdError as exc:
                if "EADDRINUSE" not in str(exc) or attempt == attempts - 1:
                    raise

    def _start_once(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        folder = tempfile.mkdtemp(prefix="spmd_stacks_")
        self._stacks = [os.path.join(folder, f"rank{r}.txt") for r in range(self.world_size)]
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, self.world_size, port,
                                                     self.pg_timeout, child, self._stacks[rank]),
                               daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(self.start_timeout, "starting the ranks")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, tuple[str, Any]] = {}
        grace = None
        while len(results) < self.world_size:
            for rank, conn in enumerate(self._conns):
                if rank in results:
                    continue
                if conn.poll(0.02):
                    try:
                        results[rank] = conn.recv()
                    except EOFError:
                        results[rank] = ("err", f"rank {rank} died (exit code "
                                                f"{self._procs[rank].exitcode})")
                elif not self._procs[rank].is_alive() and not conn.poll(0):
                    results[rank] = ("err", f"rank {rank} died (exit code "
                                            f"{self._procs[rank].exitcode})")
            failed = {r: v for r, (k, v) in results.items() if k == "err"}
            if failed and grace is None:
                # the other ranks may wait in a collective forever: give them a short grace
                # period to report their own errors, then tear down
                grace = time.monotonic() + 5.0
                deadline = min(deadline, grace)
            if time.monotonic() > deadline and len(results) < self.world_size:
                missing = sorted(set(range(self.world_size)) - set(results))
                stacks = self._dump_stacks(missing)
                self.close()
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
                detail += "".join(f"\n--- rank {r}, still running; its threads ---\n{text}"
                                  for r, text in stacks.items())
                if failed:
                    raise SpmdError(f"{what}: ranks {sorted(failed)} failed; ranks {missing} were "
                                    f"still running (likely waiting in a collective) and were "
                                    f"killed{detail}")
                raise SpmdTimeout(f"{what}: ranks {missing} did not finish within "
                                  f"{timeout:.0f} s{detail}")
        failed = {r: v for r, (k, v) in results.items() if k == "err"}
        if failed:
            self.close()
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
            raise SpmdError(f"{what}: {len(failed)} of {self.world_size} ranks failed{detail}")
        return [results[r][1] for r in range(self.world_size)]

    def run(self, fn: Callable, *, args: tuple = (), kwargs: dict | None = None,
            timeout: float = 120.0) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs or {}))
        answers = self._collect(timeout, getattr(fn, "__name__", repr(fn)))
        if max(groups for _, groups in answers) > self.max_groups:
            self.close()  # the next call starts fresh ranks
            self.restarts += 1
        return [result for result, _ in answers]

    def _dump_stacks(self, ranks: list[int], *, limit: int = 6000) -> dict[int, str]:
        """Every thread's Python stack in each of ``ranks`` (still alive), by faulthandler."""
        asked = []
        for r in ranks:
            proc = self._procs[r]
            if proc.is_alive() and hasattr(signal, "SIGUSR1"):
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    asked.append(r)
                except OSError:
                    pass
        if asked:
            time.sleep(1.0)
        out = {}
        for r in asked:
            try:
                with open(self._stacks[r]) as f:
                    text = f.read()
            except OSError:
                continue
            out[r] = text[-limit:] if text else "(no stack written)"
        return out

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                if proc.is_alive():
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        self._procs, self._conns = [], []
        if self._stacks:
            shutil.rmtree(os.path.dirname(self._stacks[0]), ignore_errors=True)
        self._stacks = []

    def __enter__(self) -> "SpmdPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_spmd(fn: Callable, world_size: int, *, args: tuple = (), kwargs: dict | None = None,
             timeout: float = 120.0, pool: SpmdPool | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` CPU ranks (gloo); results in rank order.

    With ``pool`` (an SpmdPool of the same world size) the ranks are reused; otherwise fresh ranks
    are started and stopped around the call. ``timeout`` bounds the call, start-up excluded.
    """
    if pool is not None:
        if pool.world_size != world_size:
            raise ValueError(f"pool: has world_size {pool.world_size}, got {world_size}")
        return pool.run(fn, args=args, kwargs=kwargs, timeout=timeout)
    with SpmdPool(world_size, pg_timeout=max(timeout, 30.0)) as fresh:
        return fresh.run(fn, args=args, kwargs=kwargs, timeout=timeout)
