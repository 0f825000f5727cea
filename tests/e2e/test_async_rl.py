"""Asynchronous RL and workflows in the recipe, end to end through the CLI (CPU): generation
ahead of training within rollout.max_staleness, the data cursor across --resume, a workflow run.

The bound is read from the metrics rows the run wrote (staleness from the server's own per-token
versions); the data order from the first and last data index each step trained.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import fsdpfn, grpo_rows  # tests/cli_runs.py

pytestmark = pytest.mark.dist

SHORT = ["warmup.steps=10", "warmup.target_reward=null", "prompts_per_step=8",
         "checkpoint.every=2", "eval.every=0", "log.every=1", "log.plot=false"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.timeout(300)
def test_generation_runs_ahead_within_the_bound(tmp_path):
    """Each step's rows were generated at most max_staleness versions before it trained on them.
    The data cursor across --resume with episodes in flight is the Ctrl-C test's below."""
    run_dir = tmp_path / "async"
    first = fsdpfn("demo", f"run_dir={run_dir}", "steps=4", "rollout.max_staleness=2",
                   "launch.nproc=1", *SHORT)
    assert first.returncode == 0, first.stderr[-4000:]
    rows = grpo_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= 2 for r in rows), [r["staleness_max"] for r in rows]
    assert rows[0]["staleness_max"] == 0 and max(r["staleness_max"] for r in rows) >= 1
    assert all(0.0 <= r["off_policy_token_frac"] <= 1.0 for r in rows)
    # elapsed is stamped at the step's end: its rise covers the step's seconds, the
    # checkpoint of every second step included (it was stamped before the save)
    rises = [b["elapsed"] - a["elapsed"] for a, b in zip(rows, rows[1:])]
    assert all(rise >= r["seconds"] for rise, r in zip(rises, rows[1:])), (rises, rows)
    assert all(r["checkpoint_seconds"] > 0 for r in rows if r["step"] % 2 == 0)
    # the demo's PPO (8 minibatches, a KL to the reference) runs both log-prob passes
    assert all((r["ref_logp_pass"], r["old_logp_pass"]) == (1, 1) for r in rows)
    # each step trained the next 8 prompts of the data order: none twice, none skipped
    assert [(r["data_first"], r["data_last"]) for r in rows] == \
        [(8 * k, 8 * k + 7) for k in range(4)]
    assert [r["data_cursor"] for r in rows] == [8 * (k + 1) for k in range(4)]


def test_bad_bounds_and_workflows_are_refused_before_launch(tmp_path):
    for override, words in (("rollout.max_staleness=-1", "max_staleness: must be >= 0"),
                            ("rollout.max_staleness=1.5", "max_staleness: must be an integer"),
                            ("rollout.workflow=no_such_module_x:fn", "rollout.workflow")):
        out = fsdpfn("demo", f"run_dir={tmp_path / 'bad'}", override, "--dry-run", timeout=60)
        assert out.returncode != 0 and words in out.stderr, (override, out.stderr[-2000:])
        assert len(out.stderr.strip().splitlines()) <= 2, out.stderr


def test_a_bound_with_a_server_that_is_not_fsdpfns_is_refused(tmp_path):
    """A stock SGLang server (here the test suite's stand-in speaking SGLang's protocol)
    cannot bound staleness: it pauses around updates and names one version per request."""
    from sglang_standin import serve  # tests/sglang_standin.py

    from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

    model = save_tiny_model(tmp_path / "m", tiny_qwen2_config(), seed=0)
    _, server, url = serve(model)
    from fsdpfn.wire.ports import free_port

    try:
        out = fsdpfn("demo", f"run_dir={tmp_path / 'x'}", f"rollout.url={url}",
                     "rollout.max_staleness=1", "--dry-run", timeout=60)
        # several servers: each is checked (the second is never reached: the first is refused)
        many = fsdpfn("demo", f"run_dir={tmp_path / 'y'}",
                      f"rollout.url={url},http://127.0.0.1:{free_port()}",
                      "rollout.max_staleness=1", "--dry-run", timeout=60)
    finally:
        server.shutdown()
    for got in (out, many):
        assert got.returncode != 0, got.stderr[-2000:]
        assert "rollout.max_staleness" in got.stderr, got.stderr[-2000:]
        assert "not fsdpfn's rollout server" in got.stderr and url in got.stderr, got.stderr


def _stopped_after_a_step(args: list[str], run_dir: Path, env: dict) -> None:
    """``fsdpfn *args`` (a long run) stopped by SIGINT once its first RL step is written; it
    must exit 130, having saved its last step."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "fsdpfn", *args], stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").is_file() and grpo_rows(run_dir):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-4000:]


@pytest.mark.timeout(600)
def test_ctrl_c_with_episodes_in_flight_then_resume_trains_every_prompt_once(tmp_path):
    run_dir = tmp_path / "stop"
    spec = f"rollout.workflow={EXAMPLES / 'workflows.py'}:check_and_retry"
    short = [a if not a.startswith("prompts_per_step=") else "prompts_per_step=4" for a in SHORT]
    args = ["demo", f"run_dir={run_dir}", spec, "rollout.max_staleness=1", *short]
    # the next step's episodes are in flight at the stop (staleness 1)
    _stopped_after_a_step([*args, "steps=40"], run_dir, {})
    stopped = grpo_rows(run_dir)[-1]["step"]
    again = fsdpfn(*args, f"steps={stopped + 2}", "--resume")
    assert again.returncode == 0, again.stderr[-4000:]
    rows = grpo_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, stopped + 3))
    assert [(r["data_first"], r["data_last"]) for r in rows] == \
        [(4 * k, 4 * k + 3) for k in range(stopped + 2)]
    assert all(r["staleness_max"] <= 1 and r["episode_errors"] == 0 for r in rows)
    # 4 data rows x 8 episodes a step, one joined row each (the retry extends the first answer)
    assert all(r["episodes"] == 32 and r["episode_rows"] == 32 for r in rows), rows
    assert all(1.0 <= r["turns_per_episode"] <= 2.0 for r in rows)


@pytest.mark.timeout(400)
def test_ctrl_c_in_a_synchronous_workflow_run_starts_no_episode_it_does_not_train(tmp_path):
    """At max_staleness 0 the next step's episodes wait for the step's end: a stop agreed there
    starts none (they were started before the stop was read, run, and thrown away, and the
    resumed run ran them again: a workflow's side effects twice)."""
    run_dir, log = tmp_path / "stop0", tmp_path / "episodes.jsonl"
    spec = f"rollout.workflow={Path(__file__).with_name('workflows_for_tests.py')}:logged_retry"
    short = [a if not a.startswith("prompts_per_step=") else "prompts_per_step=2" for a in SHORT]
    _stopped_after_a_step(["demo", f"run_dir={run_dir}", spec, "advantage.group_size=2",
                           "ppo.n_minibatches=1", *short, "steps=40"], run_dir,
                          {"FSDPFN_TEST_WF_LOG": str(log)})
    trained = len(grpo_rows(run_dir))
    started = log.read_text().splitlines()
    assert len(started) == trained * 2 * 2, (len(started), trained)  # prompts x group_size


@pytest.mark.timeout(300)
def test_one_minibatch_skips_the_old_logp_pass_and_no_kl_skips_the_reference(tmp_path):
    run_dir = tmp_path / "passes"
    done = fsdpfn("demo", f"run_dir={run_dir}", "steps=2", "ppo.n_minibatches=1",
                  "ppo.kl_coef=0", "launch.nproc=1", *SHORT)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = grpo_rows(run_dir)
    assert [(r["ref_logp_pass"], r["old_logp_pass"]) for r in rows] == [(0, 0), (0, 0)]
    assert all(r["ratio_max"] == 1.0 and r["clip_frac"] == 0.0 for r in rows), rows
