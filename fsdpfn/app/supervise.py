"""The run directory says how the last run ended (the processes themselves die with their
launcher: fsdpfn/wire/lifeline.py).

``run_dir/run_state.json`` holds the launcher's record of the run:

    {"status": "running", "pid": 4242, "started": "<ISO time>", ...}   at start
    {"status": "done" | "failed" | "interrupted", "exit_code": 0, "ended": ..., ...}   at the end

A state still "running" whose launcher is gone means the launcher was killed (SIGKILL, OOM
killer, a lost machine): ``last_run(run_dir)`` reports it as "killed".
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from fsdpfn.wire.lifeline import pid_alive, process_start_time

__all__ = ["RUN_STATE", "write_run_state", "read_run_state", "last_run", "describe_last_run"]

RUN_STATE = "run_state.json"


# ---------------------------------------------------------------- the run's state file


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def read_run_state(run_dir: str | os.PathLike) -> dict | None:
    """run_dir/run_state.json, or None when there is none (or it cannot be read)."""
    try:
        state = json.loads((Path(run_dir) / RUN_STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def write_run_state(run_dir: str | os.PathLike, status: str, **fields) -> dict:
    """Write run_state.json atomically. "running" starts a new record (this process's pid, the
    start time, the host); any other status updates it with ``ended``."""
    path = Path(run_dir) / RUN_STATE
    if status == "running":
        state = {"status": status, "pid": os.getpid(), "pid_start": process_start_time(os.getpid()),
                 "host": socket.gethostname(), "started": _now(), **fields}
    else:
        state = {**(read_run_state(run_dir) or {}), "status": status, "ended": _now(),
                 **fields}
    tmp = path.with_name(f".{RUN_STATE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)
    return state


def last_run(run_dir: str | os.PathLike) -> dict | None:
    """The last run's record with its ``status`` resolved: "running" only while its launcher
    runs (same host, live pid of the same start time); "killed" when it is gone without having
    written an end; else as recorded ("done", "failed", "interrupted"). None: no record."""
    state = read_run_state(run_dir)
    if state is None or state.get("status") != "running":
        return state
    pid, host = state.get("pid"), state.get("host")
    if host not in (None, socket.gethostname()):
        return state  # another machine's launcher: it cannot be checked from here
    if isinstance(pid, int) and pid_alive(pid, state.get("pid_start")):
        return state
    return {**state, "status": "killed"}


def describe_last_run(state: dict) -> str:
    """One sentence about a run record from ``last_run``."""
    status = state.get("status")
    pid, started = state.get("pid"), state.get("started", "?")
    if status == "killed":
        return (f"the last run was killed: its launcher (pid {pid}, started {started}) is gone "
                f"and never recorded an end")
    if status == "running":
        return (f"a run is in progress (launcher pid {pid} on {state.get('host')}, started "
                f"{started})")
    ended = state.get("ended", "?")
    return f"the last run ended {status} (exit {state.get('exit_code')}) at {ended}"
