"""What the end-to-end tests of `fsdpfn run` / `fsdpfn demo` share: the command in a
subprocess, a run's metrics rows of the grpo phase, whether a server's port still answers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def fsdpfn(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    """``python -m fsdpfn ARGS`` with one CPU thread per process, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fsdpfn", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def grpo_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "grpo"]


def port_open(url: str) -> bool:
    host, port = url.rsplit("//", 1)[1].split(":")
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, int(port))) == 0
