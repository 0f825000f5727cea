"""The processes of a run die with their launcher, and run_dir/run_state.json says how the last
run ended (fsdpfn.app.supervise, fsdpfn/app/launcher.py).

The end-to-end case: the GRPO demo's launcher killed with SIGKILL after its first metrics line
leaves no process of the run (the trainer ranks, the rollout server) alive within
10 s, the next ``fsdpfn demo`` says the last run was killed, and ``--resume`` continues.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsdpfn.app.cli import main
from fsdpfn.app.supervise import describe_last_run, last_run, read_run_state, write_run_state
from fsdpfn.wire.lifeline import LAUNCHER_PID_ENV, pid_alive


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _wait_dead(pids, seconds: float) -> list[int]:
    """The pids still alive after up to ``seconds`` (zombies count as dead)."""
    deadline = time.monotonic() + seconds
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------- the mechanisms, one by one


@pytest.mark.timeout(60)
def test_die_with_parent_kills_the_child_when_its_parent_is_killed(tmp_path):
    """A child started with die_with_parent() dies when its parent is SIGKILLed."""
    parent_code = textwrap.dedent("""
        import subprocess, sys, time
        from fsdpfn.wire.lifeline import die_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 preexec_fn=die_with_parent(), start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True, env=_env())
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_dead([child], 5) == [], "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()


@pytest.mark.timeout(60)
def test_watch_launcher_exits_the_process_when_the_launcher_is_gone():
    """A rank (any process with FSDPFN_LAUNCHER_PID) exits within about a second of its
    launcher, even when it is not the launcher's child."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = ("import time\nfrom fsdpfn.wire.lifeline import watch_launcher\n"
            "watch_launcher('trainer rank 0', interval=0.1)\nprint('up', flush=True)\n"
            "time.sleep(120)\n")
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=_env(**{LAUNCHER_PID_ENV: str(launcher.pid)}))
    try:
        assert rank.stdout.readline().strip() == "up"
        time.sleep(0.3)
        assert rank.poll() is None, "exited while its launcher runs"
        launcher.kill()
        launcher.wait()
        assert rank.wait(timeout=5) == 1
        assert f"its launcher (pid {launcher.pid}) is gone" in rank.stderr.read()
    finally:
        launcher.kill()
        rank.kill()


def test_run_state_records_the_end_and_a_killed_launcher(tmp_path):
    assert last_run(tmp_path) is None
    state = write_run_state(tmp_path, "running", recipe="grpo")
    assert state["pid"] == os.getpid() and last_run(tmp_path)["status"] == "running"
    done = write_run_state(tmp_path, "done", exit_code=0)
    assert done["started"] == state["started"] and last_run(tmp_path)["status"] == "done"
    assert "ended done (exit 0)" in describe_last_run(last_run(tmp_path))
    # a record left "running" by a launcher that is gone: killed
    state["pid"] = _dead_pid()
    (tmp_path / "run_state.json").write_text(json.dumps(state))
    killed = last_run(tmp_path)
    assert killed["status"] == "killed" and read_run_state(tmp_path)["status"] == "running"
    assert describe_last_run(killed).startswith("the last run was killed")
    # a live pid of another process (a reused pid): its start time differs
    state.update(pid=os.getpid(), pid_start="1")
    (tmp_path / "run_state.json").write_text(json.dumps(state))
    assert last_run(tmp_path)["status"] == "killed"


@pytest.mark.timeout(120)
def test_the_launcher_refuses_a_run_dir_in_use_and_names_a_killed_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_run_state(run_dir, "running", recipe="grpo")  # this process plays a live launcher
    assert main(["demo", f"run_dir={run_dir}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "run_dir: must not be in use by another run" in err and str(os.getpid()) in err
    assert err.count("\n") == 1, err
    state = read_run_state(run_dir)
    state["pid"] = _dead_pid()
    (run_dir / "run_state.json").write_text(json.dumps(state))
    (run_dir / "metrics.jsonl").write_text("")
    assert main(["demo", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert "holds a previous run (metrics.jsonl; the last run was killed" in err, err
    assert "pass --resume" in err and err.count("\n") == 1, err


# ---------------------------------------------------------------- end to end


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _grpo_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return [r for r in rows if r.get("phase") == "grpo"]


def _published(run_dir: Path) -> list[Path]:
    """Complete checkpoints: renamed into place (step_N), or marked and not yet renamed
    (step_N.tmp-<token>: a save killed between the two, which --resume publishes first and
    continues from)."""
    root = run_dir / "checkpoints"
    return [p for p in root.iterdir() if re.fullmatch(r"step_\d+(\.tmp-[0-9a-f]{32})?", p.name)
            and (p / "COMPLETE").is_file()] if root.is_dir() else []


DEMO = ["warmup.steps=5", "warmup.target_reward=null", "prompts_per_step=4", "eval.every=0",
        "checkpoint.every=1", "log.plot=false"]


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the pids")
def test_sigkill_of_the_launcher_leaves_no_process_and_resume_continues(tmp_path):
    run_dir = tmp_path / "killed"
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "fsdpfn", "demo", f"run_dir={run_dir}",
                                 "steps=200", *DEMO], stdout=log, stderr=subprocess.STDOUT,
                                env=_env())
    try:
        deadline = time.monotonic() + 240
        # a step trained and its checkpoint published (saves run in the background: the step's
        # metrics row can come before its checkpoint)
        while not (_grpo_rows(run_dir) and _published(run_dir)) and launcher.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()[-3000:]
            time.sleep(0.2)
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
        ranks = [int(p.read_text()) for p in sorted((run_dir / ".ranks").glob("rank*.pid"))]
        serving = re.search(r"fsdpfn.rollout: serving .* pid (\d+)",
                            (run_dir / "rollout.log").read_text())
        server = int(serving.group(1))
        tree = _descendants(launcher.pid)
        assert len(ranks) == 2 and set(ranks) | {server} <= tree, (ranks, server, tree)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        alive = _wait_dead(tree, 10)
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
                    for p in alive if Path(f"/proc/{p}/cmdline").exists()}
        assert not alive, f"alive 10 s after the launcher was killed: {cmdlines}"
    finally:
        launcher.kill()
        for pid in _descendants(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        log.close()
    state = read_run_state(run_dir)
    assert state["status"] == "running" and state["pid"] == launcher.pid
    assert last_run(run_dir)["status"] == "killed"
    done = sorted(int(p.name.split("_")[1].split(".")[0]) for p in _published(run_dir))
    assert done, "no checkpoint before the kill"

    # the next launch names the killed run, and --resume continues from the last checkpoint
    resumed = subprocess.run([sys.executable, "-m", "fsdpfn", "demo", f"run_dir={run_dir}",
                              f"steps={done[-1] + 1}", *DEMO, "--resume"], capture_output=True,
                             text=True, timeout=240, env=_env())
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "the last run was killed" in resumed.stderr, resumed.stderr[-4000:]
    assert re.search(rf"resumed from \S+step_0*{done[-1]} at step {done[-1]}", resumed.stderr)
    assert _grpo_rows(run_dir)[-1]["step"] == done[-1] + 1
    final = read_run_state(run_dir)
    assert final["status"] == "done" and final["exit_code"] == 0 and final["resume"] is True
