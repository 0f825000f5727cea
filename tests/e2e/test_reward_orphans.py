"""Reward workers die with the process that started them, even in the middle of a call.

The smallest real process tree of a run's scoring: a parent process (standing in for trainer
rank 0) starts a RewardPool whose reward does not return (it sleeps, or holds the GIL in a
backtracking regex), asks it to score, and is killed with SIGKILL while the calls run. No
worker may outlive it: before, each worker noticed its parent only when its call returned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fsdpfn.wire.lifeline import pid_alive

REWARDS = '''
import os, re, time
from pathlib import Path

def _started():
    Path(os.environ["ORPHAN_DIR"], f"started-{os.getpid()}").touch()

def sleepy(prompt, completion, **kwargs):
    _started()
    time.sleep(300)
    return 1.0

def backtracking(prompt, completion, **kwargs):
    _started()
    # catastrophic backtracking: the regex engine holds the GIL until it gives up (never)
    return float(re.match(r"(a+)+$", "a" * 60 + "b") is not None)
'''

# the stand-in for rank 0: start the pool (in the main thread, or in a thread that has ended
# before scoring), print the worker pids, score, wait to be killed
PARENT = textwrap.dedent('''
    import sys, threading
    from fsdpfn.app.recipes.reward import RewardPool

    spec, workers, in_thread = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "thread"
    pool = RewardPool(spec, workers=workers, timeout_s=300)
    if in_thread:
        t = threading.Thread(target=pool.start)
        t.start()
        t.join()
    else:
        pool.start()
    print(" ".join(map(str, pool.pids)), flush=True)
    n = workers
    pool.score([f"p{i}" for i in range(n)], [f"c{i}" for i in range(n)])
''')


@pytest.fixture()
def rewards_pkg(tmp_path):
    (tmp_path / "orphanrewards.py").write_text(REWARDS)
    return tmp_path


def _wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill_parent_mid_call(pkg: Path, fn: str, workers: int, where: str) -> list[int]:
    """Start the parent, wait until every worker is inside its call, SIGKILL the parent;
    the worker pids still alive 5 s later."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ORPHAN_DIR": str(pkg),
           "PYTHONPATH": os.pathsep.join([str(pkg), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, f"orphanrewards:{fn}",
                               str(workers), where], stdout=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == workers, f"the parent printed no worker pids (exit {parent.poll()})"
        started = lambda: len(list(pkg.glob("started-*"))) == workers  # noqa: E731
        assert _wait(started, 30), "the workers never entered their reward calls"
        assert all(pid_alive(p) for p in pids)
        parent.kill()
        parent.wait(timeout=10)
        _wait(lambda: not any(pid_alive(p) for p in pids), 5)
        return [p for p in pids if pid_alive(p)]
    finally:
        parent.kill()
        for p in pids:  # never leave a sleeper or a spinning regex behind, pass or fail
            if pid_alive(p):
                os.kill(p, 9)


@pytest.mark.timeout(60)
def test_sigkill_of_the_parent_mid_call_leaves_no_reward_worker(rewards_pkg):
    alive = _kill_parent_mid_call(rewards_pkg, "sleepy", 4, "main")
    assert alive == [], f"reward workers {alive} outlived their SIGKILLed parent"


@pytest.mark.timeout(60)
def test_a_worker_holding_the_gil_dies_with_its_parent(rewards_pkg):
    """No Python code of the worker can run while its call holds the GIL: the kernel kills it
    (PR_SET_PDEATHSIG), not a thread of its own."""
    alive = _kill_parent_mid_call(rewards_pkg, "backtracking", 1, "main")
    assert alive == [], f"reward worker {alive} outlived its SIGKILLed parent"


@pytest.mark.timeout(60)
def test_workers_started_from_an_ended_thread_live_until_the_parent_dies(rewards_pkg):
    """The kernel ties the parent-death signal to the thread that forked; a pool started from a
    thread that has since ended must keep its workers (they enter their calls after the thread
    ended) and still lose them with the process."""
    alive = _kill_parent_mid_call(rewards_pkg, "sleepy", 2, "thread")
    assert alive == [], f"reward workers {alive} outlived their SIGKILLed parent"


@pytest.mark.timeout(60)
def test_a_rank_whose_output_pipe_died_with_the_launcher_still_exits():
    """The link above the workers: a rank exits when its launcher is gone, even though its
    stdout and stderr were a pipe read by the launcher (the launcher keeps trainer.log), so
    saying why it exits fails with a broken pipe."""
    launcher_code = textwrap.dedent('''
        import os, subprocess, sys, time
        code = ("import time\\nfrom fsdpfn.wire.lifeline import watch_launcher\\n"
                "watch_launcher('trainer rank 0', interval=0.1)\\ntime.sleep(120)\\n")
        rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "FSDPFN_LAUNCHER_PID": str(os.getpid())})
        print(rank.pid, flush=True)
        time.sleep(120)
    ''')
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rank = None
    try:
        rank = int(launcher.stdout.readline())
        time.sleep(1.0)  # the rank is up and watching
        assert pid_alive(rank)
        launcher.kill()
        launcher.wait(timeout=10)
        _wait(lambda: not pid_alive(rank), 5)
        assert not pid_alive(rank), "the rank outlived its launcher (its output pipe is broken)"
    finally:
        launcher.kill()
        if rank is not None and pid_alive(rank):
            os.kill(rank, 9)


@pytest.mark.timeout(120)
def test_a_server_from_launch_server_dies_with_the_script_that_started_it(tmp_path):
    """A custom loop's rollout server (fsdpfn.rollout.launch_server) is a process of that run
    too: kill -9 of the script must not leave it serving."""
    from fsdpfn.testing.hf_dir import write_tiny_hf_dir

    model = write_tiny_hf_dir(tmp_path / "model", texts=["a b c"], num_layers=1)
    script = textwrap.dedent(f'''
        import time
        from fsdpfn.rollout.process import launch_server
        server = launch_server({str(model)!r}, log_dir={str(tmp_path)!r}, health_timeout=90)
        print(server.proc.pid, flush=True)
        time.sleep(120)
    ''')
    loop = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    server = None
    try:
        server = int(loop.stdout.readline())
        assert pid_alive(server)
        loop.kill()
        loop.wait(timeout=10)
        _wait(lambda: not pid_alive(server), 5)
        assert not pid_alive(server), "the rollout server outlived the script that started it"
    finally:
        loop.kill()
        if server is not None and pid_alive(server):
            os.kill(server, 9)
