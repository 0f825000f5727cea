"""A Python without the rollout server's packages (`pip install fsdpfn` without the `server`
extra): every door to the server says what is missing and how to install it, in one line,
before a process starts or a port is bound. Before, `fsdpfn demo` trained its warm-up, then
stopped on the server's `ModuleNotFoundError: No module named 'uvicorn'` traceback.

And every `pip install 'fsdpfn[...]'` that fsdpfn's messages suggest names an extra that
pyproject.toml defines (the workflow's openai hint named one that did not exist). Last, what a
server started by launch_server leaves behind: its own log directory only where it is worth
reading."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import tomllib
from pathlib import Path

import pytest

from fsdpfn.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def without_uvicorn(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "uvicorn" else real(name, *a, **k))


def test_the_recipes_refuse_before_launch_naming_the_extra(without_uvicorn, tmp_path,
                                                           monkeypatch):
    from fsdpfn.app.cli import main

    monkeypatch.chdir(ROOT)
    for recipe in ("grpo", "ppo"):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = main(["run", f"examples/{recipe}.yaml", "--dry-run", f"run_dir={tmp_path}/r"])
        line = err.getvalue().strip().splitlines()[-1]
        assert rc == 2 and line.startswith(
            "fsdpfn: error: rollout.url: null starts fsdpfn's rollout server, which needs "
            "fastapi and uvicorn (pip install 'fsdpfn[server]'); this Python (") and line.endswith(
            ") lacks uvicorn; or set rollout.url to a running server, got None"), line
        assert not (tmp_path / "r").exists()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["run", "examples/sft.yaml", "--dry-run", f"run_dir={tmp_path}/s"]) == 0


def test_the_preflight_takes_an_external_server_without_them(without_uvicorn):
    from fsdpfn.app.recipes import default_config
    from fsdpfn.app.recipes.preflight import check_rollout

    check_rollout(default_config("grpo", ["rollout.url=http://127.0.0.1:9"]))
    with pytest.raises(ConfigError, match=r"^rollout\.url: null starts"):
        check_rollout(default_config("grpo"))


def test_launch_server_raises_before_starting_a_process(without_uvicorn, tmp_path, monkeypatch):
    import subprocess

    from fsdpfn.rollout import launch_server

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ModuleNotFoundError, match=r"^launch_server: the rollout server needs "
                       r"fastapi and uvicorn \(pip install 'fsdpfn\[server\]'\); this Python "
                       r"\(.*\) lacks uvicorn$"):
        launch_server(tmp_path, log_dir=tmp_path)
    assert started == [] and list(tmp_path.iterdir()) == []


def test_the_servers_command_line_exits_with_one_line(without_uvicorn, capsys, monkeypatch):
    import socket

    from fsdpfn.rollout.__main__ import main

    bound = []
    monkeypatch.setattr(socket, "socket", lambda *a, **k: bound.append(a))
    with pytest.raises(SystemExit) as info:
        main(["--model", "/nonexistent", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and bound == [] and len(err) == 1
    assert err[0].startswith("python -m fsdpfn.rollout: error: the rollout server needs "
                             "fastapi and uvicorn") and err[0].endswith("lacks uvicorn"), err


def test_every_extra_a_message_suggests_exists():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    named = {}
    for path in sorted((ROOT / "fsdpfn").rglob("*.py")) + sorted((ROOT / "docs").glob("*.md")):
        for extra in re.findall(r"fsdpfn\[([a-z0-9_,-]+)\]", path.read_text()):
            for name in extra.split(","):
                named.setdefault(name, path.relative_to(ROOT).as_posix())
    assert {"server", "agents", "math", "wandb", "recipes", "gpu"} <= set(named), named
    missing = {name: where for name, where in named.items() if name not in extras}
    assert not missing, f"extras suggested but not in pyproject.toml: {missing}"


@pytest.mark.timeout(120)
def test_the_log_directory_launch_server_made_goes_with_a_server_stopped_by_its_owner(tmp_path,
                                                                                      monkeypatch):
    """Without log_dir, launch_server logs into a temporary directory of its own; each call left
    one behind (a hundred and more in /tmp after a day of test runs). close() now removes it
    when it stops a running server; a server that died on its own keeps its log, as does a
    directory the caller named."""
    import os
    import signal
    import tempfile

    from fsdpfn.rollout import launch_server
    from fsdpfn.testing import write_tiny_hf_dir

    model = write_tiny_hf_dir(tmp_path / "tiny", texts=["a b c"] * 10)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes its dirs

    def made():
        return sorted(p.name for p in tmp_path.glob("fsdpfn-rollout-*"))

    with launch_server(model, dtype="float32", extra_args=("--no-channel",)) as server:
        assert made() and server.log_path.is_file()
    assert made() == []
    crashed = launch_server(model, dtype="float32", extra_args=("--no-channel",))
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.proc.wait(timeout=10)
    crashed.close()
    assert crashed.log_path.is_file() and len(made()) == 1  # read it: the server died by itself
    mine = tmp_path / "mine"
    with launch_server(model, dtype="float32", log_dir=mine, extra_args=("--no-channel",)):
        pass
    assert len(list(mine.glob("rollout-*.log"))) == 1
