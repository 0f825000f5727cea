"""Start a rollout server as a subprocess and wait until it answers /health (with a deadline).

    with launch_server("ckpt/", device="cpu") as server:      # killed on exit, even on errors
        target = ff.RolloutTarget(server.url)

The server listens on 127.0.0.1 on a free port; its output goes to ``server.log_path``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from fsdpfn.wire.ports import free_port

__all__ = ["RolloutProcess", "launch_server", "free_port", "wait_for_model_dir",
           "missing_server_packages", "SERVER_PACKAGES"]

# what the rollout server imports beyond fsdpfn's own dependencies (the 'server' extra)
SERVER_PACKAGES = ("fastapi", "uvicorn")


def missing_server_packages() -> str | None:
    """None when this Python can run the rollout server, else what it needs, how to install it
    and what is missing ("needs fastapi and uvicorn (pip install ...); this Python (...) lacks
    uvicorn"), found without importing them."""
    import importlib.util

    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"needs {' and '.join(SERVER_PACKAGES)} (pip install 'fsdpfn[server]'); this Python "
            f"({sys.executable}) lacks {' and '.join(missing)}")


class RolloutProcess:
    """A running ``python -m fsdpfn.rollout``; ``close()`` kills it (idempotent). ``own_dir``:
    the log directory launch_server made itself (no ``log_dir`` given), which ``close()``
    removes when it stops a running server; a server that exited on its own keeps its log at
    ``log_path``."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path,
                 own_dir: Path | None = None):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.own_dir = own_dir

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str, timeout: float = 10.0) -> dict:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.url + path, timeout=timeout) as resp:
            return json.loads(resp.read())

    def status(self, path: str, timeout: float = 10.0) -> int:
        """The HTTP status of a GET (SGLang's /health answers an empty body)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.url + path, timeout=timeout) as resp:
            return resp.status

    def post(self, path: str, payload: dict, timeout: float = 60.0) -> dict:
        """POST JSON; an HTTP error answer is returned as its JSON body plus "status"."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with opener.open(req, timeout=timeout) as resp:
                return {"status": resp.status, **json.loads(resp.read())}
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, **json.loads(exc.read() or b"{}")}

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"rollout server exited with {self.proc.returncode} before "
                                   f"answering /health:\n{self.log()}")
            try:
                if self.status("/health", timeout=2.0) == 200:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"rollout server at {self.url} did not answer /health within "
                           f"{timeout:.0f} s:\n{self.log()}")

    def close(self) -> None:
        running = self.proc.poll() is None
        if running:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if running and self.own_dir is not None:  # stopped by its owner: nothing to read later
            import shutil

            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = None

    def __enter__(self) -> "RolloutProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch_server(model: str | os.PathLike, *, port: int | None = None, device: str = "cpu",
                  dtype: str = "auto", threads: int | None = 1, weight_version: int = 0,
                  health_timeout: float = 120.0, log_dir: str | os.PathLike | None = None,
                  extra_args: tuple[str, ...] = (), env: dict | None = None,
                  new_session: bool = False) -> RolloutProcess:
    """Start ``python -m fsdpfn.rollout`` on 127.0.0.1 and wait for /health (killed on failure).

    ``env`` adds variables to the server's environment (e.g. CUDA_VISIBLE_DEVICES).
    ``new_session``: start it in its own session, so a Ctrl-C (SIGINT to the terminal's process
    group) in the caller does not reach it; close() still kills it. A port of its own choosing
    (``port`` None) that another process takes between the choice and the bind is chosen again
    (three tries)."""
    lacking = missing_server_packages()
    if lacking is not None:  # before a process starts only to die on its imports
        raise ModuleNotFoundError(f"launch_server: the rollout server {lacking}",
                                  name=SERVER_PACKAGES[0])
    _check_flags(_flags(model, port or 0, device, dtype, weight_version, threads, extra_args))
    kwargs = dict(device=device, dtype=dtype, threads=threads, weight_version=weight_version,
                  health_timeout=health_timeout, log_dir=log_dir, extra_args=extra_args,
                  env=env, new_session=new_session)
    tries = 1 if port else 3
    while True:
        tries -= 1
        try:
            return _launch(model, port=port or free_port(), **kwargs)
        except RuntimeError as exc:
            if not tries or "address already in use" not in str(exc).lower():
                raise


def _flags(model, port: int, device: str, dtype: str, weight_version: int, threads: int | None,
           extra_args: tuple[str, ...]) -> list[str]:
    """The server's command line after ``python -m fsdpfn.rollout``; --parent-pid: it exits when
    this process does, even by SIGKILL."""
    flags = ["--model", str(model), "--port", str(port), "--host", "127.0.0.1",
             "--device", str(device), "--dtype", str(dtype), "--weight-version",
             str(weight_version), "--parent-pid", str(os.getpid()), *map(str, extra_args)]
    return flags + (["--threads", str(threads)] if threads else [])


def _check_flags(flags: list[str]) -> None:
    """The server's own command line rules, applied here: a bad argument is one ConfigError
    line before a process starts (the server would print its usage and exit)."""
    from fsdpfn.errors import ConfigError
    from fsdpfn.rollout.args import parse_strict

    def refuse(message: str):
        raise ConfigError(f"launch_server: the server's command line refuses {message}")

    parse_strict(flags, refuse)


def _launch(model, *, port: int, device: str, dtype: str, threads: int | None,
            weight_version: int, health_timeout: float, log_dir, extra_args: tuple[str, ...],
            env: dict | None, new_session: bool) -> RolloutProcess:
    own_dir = None if log_dir else Path(tempfile.mkdtemp(prefix="fsdpfn-rollout-"))
    log_dir = Path(log_dir or own_dir)
    log_dir.mkdir(parents=True, exist_ok=True)  # a directory named for the logs is made
    log_path = log_dir / f"rollout-{port}.log"
    cmd = [sys.executable, "-m", "fsdpfn.rollout",
           *_flags(model, port, device, dtype, weight_version, threads, extra_args)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads or os.environ.get("OMP_NUM_THREADS", 1)),
           **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=new_session)
    server = RolloutProcess(proc, f"http://127.0.0.1:{port}", log_path, own_dir)
    try:
        server.wait_healthy(health_timeout)
    except BaseException:
        server.own_dir = None  # a start that failed keeps its log for the error's reader
        server.close()
        raise
    return server


def wait_for_model_dir(model: str | os.PathLike, timeout_s: float) -> bool:
    """True once ``model``/config.json exists (a writer publishes the directory whole, by a
    rename), False after ``timeout_s`` without it: the server started with --wait-for-model and
    the trainer ranks beside the one that writes run_dir/model0 wait with it."""
    config = Path(model) / "config.json"
    deadline = time.monotonic() + timeout_s
    while not config.is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
