"""A plain-def workflow that never returns is scored as a timeout and cannot hold the run's exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("openai")

CODE = textwrap.dedent("""
    import sys, time
    from fsdpfn.app.recipes.workflow import Workflow, run_episodes

    def hangs(client, row):
        time.sleep(3600)

    def answers(client, row):
        return 1.0

    out = run_episodes("http://127.0.0.1:9", Workflow(hangs, False, "t:hangs"), [{}], 2,
                       timeout_s=0.5, on_error=-1.0)
    assert [r.reward for r in out] == [-1.0, -1.0], out
    assert all(r.error.startswith("timeout") for r in out), out
    out = run_episodes("http://127.0.0.1:9", Workflow(answers, False, "t:answers"), [{}, {}], 1,
                       on_error=-2.0)
    # it returned, without a request through its client: an error, not a reward of 1
    assert [r.reward for r in out] == [-2.0, -2.0], out
    assert all(r.error.startswith("made no request") for r in out), out
    print("scored", flush=True)
""")


@pytest.mark.timeout(60)
def test_a_hung_plain_workflow_times_out_and_the_process_still_exits():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          timeout=45)
    assert proc.returncode == 0 and "scored" in proc.stdout, proc.stderr[-3000:]
    assert time.perf_counter() - t0 < 40  # the sleeping thread did not hold the exit
