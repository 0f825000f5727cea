"""`fsdpfn run` as a user meets it: engine options from YAML, refusals before launch in one line,
a rank's failure in one line, overrides after flags, and a GRPO run with 1,024-token responses
on default settings (CPU). A resume with an override after ``--resume`` runs in
test_user_data (the SFT run that resumes from its own config.yaml)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdpfn import serde
from fsdpfn.app.recipes import RECIPE_CONFIGS, load_recipe_config
from fsdpfn.testing.hf_dir import write_tiny_hf_dir

pytestmark = pytest.mark.dist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _fsdpfn(*args, timeout=120, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdpfn", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("fsdpfn: error:")]


@pytest.mark.timeout(120)
def test_overrides_after_flags_and_config_prints_a_file_resolved(tmp_path):
    run_dir = tmp_path / "r"
    for args in (["--dry-run", "steps=7", f"run_dir={run_dir}"],
                 [f"run_dir={run_dir}", "--dry-run", "steps=7", "--overwrite"]):
        proc = _fsdpfn("run", EXAMPLES / "sft.yaml", *args)
        assert proc.returncode == 0, proc.stderr
        cfg = serde.from_yaml(proc.stdout, RECIPE_CONFIGS["sft"])
        assert cfg.steps == 7 and cfg.run_dir == str(run_dir)
    assert not run_dir.exists()
    proc = _fsdpfn("config", EXAMPLES / "sft.yaml", "engine.gradient_checkpointing=true",
                   "engine.fsdp.offload_params=true")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["engine"]["gradient_checkpointing"] is True
    assert data["engine"]["fsdp"]["offload_params"] is True
    assert data["batch_size"] == 128  # the file's own value
    expected = load_recipe_config(EXAMPLES / "sft.yaml", ["engine.gradient_checkpointing=true",
                                                          "engine.fsdp.offload_params=true"])
    assert serde.structure(data, RECIPE_CONFIGS["sft"]) == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides,message", [
    (["engine.gradient_checkpoint=true"],
     "engine: unknown key(s) ['gradient_checkpoint']; did you mean 'gradient_checkpointing'?"),
    (["mb_spec.max_tokens_per_mb=512"], "mb_spec: not a key here, moved to engine.mb_spec"),
    (["model.path=/nowhere", "data.train_files=[x.jsonl]", "warmup.steps=0",
      "engine.mb_spec.max_tokens_per_mb=512"],
     "engine.mb_spec.max_tokens_per_mb: must be >= data.max_prompt_tokens + "
     "data.max_response_tokens = 1024 + 1024 = 2048 tokens"),
], ids=["misspelt", "moved", "budget"])
def test_refused_before_launch_in_one_line(overrides, message, tmp_path):
    run_dir = tmp_path / "r"
    proc = _fsdpfn("run", EXAMPLES / "grpo.yaml", f"run_dir={run_dir}", "--dry-run", *overrides)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and _error_lines(proc.stderr), proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not run_dir.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["run", "demo"])
def test_resume_with_overwrite_is_refused_and_the_run_dir_is_kept(tmp_path, command):
    """--resume continues run_dir's run, --overwrite deletes it: both at once is refused in one
    line before anything is read or deleted."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    config = [EXAMPLES / "sft.yaml"] if command == "run" else []
    proc = _fsdpfn(command, *config, f"run_dir={run_dir}", "--resume", "--overwrite")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("fsdpfn: error: --overwrite: must not be given with --resume "
                           "(--resume continues the run in run_dir, --overwrite deletes it and "
                           "starts over), got both\n")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


@pytest.mark.timeout(150)
def test_a_rank_failure_is_one_line_with_the_log_path(tmp_path):
    """A typed error raised inside the trainer rank (a model directory whose config.json says
    one shape and whose weights hold another: known once the rank loads the weights, past every
    check the launcher makes) reaches the terminal as one line that names the YAML key
    (`model.path`); the traceback and the launcher's line on the failed rank are in
    trainer.log."""
    from fsdpfn.testing import write_tiny_hf_dir

    model = write_tiny_hf_dir(tmp_path / "m", texts=["1+2=3"], seed=0)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] *= 2  # the weights keep the size they were saved with
    (model / "config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "r"
    proc = _fsdpfn("run", EXAMPLES / "sft.yaml", f"run_dir={run_dir}", "launch.nproc=1",
                   "steps=2", f"model.path={model}", timeout=140)
    assert proc.returncode not in (0, 2), proc.stderr
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    log = run_dir / "trainer.log"
    assert lines[0].startswith("fsdpfn: error: ConfigError: model.path: weight "
                               "'model.layers.0.mlp.gate_proj.weight' must have shape")
    assert lines[0].endswith(f"(trace in {log})"), lines[0]
    for noise in ("Traceback", "ChildFailedError", "torch.distributed", "===="):
        assert noise not in proc.stderr, proc.stderr
    text = log.read_text()
    assert "Traceback" in text and "gate_proj" in text
    assert "[fsdpfn] trainer rank 0 exited with status 1\n" in text
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "failed" and state["error"].startswith("ConfigError: model.path")


@pytest.mark.timeout(120)
def test_external_servers_that_never_answer_fail_the_run_before_its_warm_up(tmp_path):
    """A wrong rollout.url is found before the warm-up's steps are spent (with the defaults:
    600 warm-up steps, then the wait)."""
    run_dir = tmp_path / "r"
    proc = _fsdpfn("run", "grpo", f"run_dir={run_dir}", "launch.nproc=1", "launch.device=cpu",
                   "steps=2", "warmup.steps=20", "rollout.url=http://127.0.0.1:9",
                   "rollout.health_timeout_s=2", timeout=110)
    assert proc.returncode == 1, proc.stderr
    assert _error_lines(proc.stderr)[0].startswith(
        "fsdpfn: error: WeightSyncError: rollout.url: every external server must answer "
        "/health"), proc.stderr
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == "", metrics.read_text()


@pytest.fixture(scope="module")
def long_grpo(tmp_path_factory):
    """A user's setup: a model directory with its own tokenizer, JSONL with custom column
    names, responses up to 1,024 tokens, every engine option at its default."""
    root = tmp_path_factory.mktemp("long_grpo")
    rows = [{"question": f"What is {i}+{i + 1}?", "solution": str(2 * i + 1)} for i in range(8)]
    model = write_tiny_hf_dir(root / "model", texts=[r["question"] for r in rows],
                              vocab_size=300, hidden_size=32)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # room for 64 + 1,024 tokens
    (model / "config.json").write_text(json.dumps(config))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"recipe": "grpo", "run_dir": str(root / "run"), "steps": 2, "prompts_per_step": 2,
           "seed": 9,
           "model": {"path": str(model)},
           "data": {"train_files": [str(root / "train.jsonl")], "prompt_key": "question",
                    "answer_key": "solution", "max_prompt_tokens": 64,
                    "max_response_tokens": 1024},
           "advantage": {"group_size": 4}, "ppo": {"n_minibatches": 2}, "reward": {"workers": 1},
           "launch": {"nproc": 1}, "eval": {"every": 0}}
    (root / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    return root


@pytest.mark.timeout(200)
def test_grpo_with_1024_token_responses_on_default_settings(long_grpo):
    """The issue's bar: answers may run to the 1,024-token limit, and the default (automatic)
    budget takes rows the old 512-token default refused. The random model stops rarely; its
    weights, the tokenizer and the server's draws are seeded (seed 9), so the first step's
    longest answer (790 tokens here) is the same on every run."""
    run_dir = long_grpo / "run"
    proc = _fsdpfn("run", long_grpo / "grpo.yaml", timeout=190)
    assert proc.returncode == 0, proc.stderr[-5000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["engine"]["mb_spec"]["max_tokens_per_mb"] is None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r["phase"] == "grpo"]
    assert [r["step"] for r in grpo] == [1, 2]
    assert max(r["response_len_max"] for r in grpo) > 512, grpo


@pytest.mark.timeout(120)
def test_the_fsdpfn_command_imports_a_reward_module_from_the_run_directory(tmp_path):
    """reward.fn: my_rewards:score with my_rewards.py in the directory the command runs from,
    through the installed ``fsdpfn`` script (which, unlike python -m, does not put that
    directory on the Python path)."""
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompt, completion, *, answer, sample, **kwargs):\n"
        "    return float(str(answer) in completion)\n")
    script = Path(sys.executable).parent / "fsdpfn"
    if not script.is_file():
        pytest.skip(f"the fsdpfn script is installed by pip install (not at {script}): "
                    "the tree is on the path without an install")
    proc = subprocess.run([str(script), "run", str(EXAMPLES / "grpo.yaml"), "--dry-run",
                           f"run_dir={tmp_path / 'r'}", "reward.fn=my_rewards:score"],
                          capture_output=True, text=True, timeout=100, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert not _error_lines(proc.stderr)


@pytest.mark.timeout(300)
def test_a_resumed_run_keeps_the_uninterrupted_runs_evaluations_and_draws(tmp_path):
    """A run of 4 steps against one of 2 resumed to 4 (sft, eval_every=2):

    - the held-out evaluations fall on the same steps (1, the baseline, then 2 and 4: a
      resumption evaluated its own first step, step 3, as well);
    - the global RNGs are seeded from `seed`, so each checkpoint's saved state is a function of
      the seed, and the resumed run's step-4 state is the uninterrupted run's (two runs of one
      seed saved different states: nothing seeded them);
    - every row states data_first, data_last and elapsed, as RL rows do; elapsed is stamped at
      the step's end, so each step's rise covers its seconds (its checkpoint included) and its
      eval_seconds (it was stamped before both).
    """
    import torch

    common = ["launch.device=cpu", "launch.nproc=1", "log.progress=false", "log.plot=false",
              "batch_size=8", "checkpoint.every=2", "eval_every=2"]
    for run_dir, steps in (("a", 4), ("b", 2)):
        done = _fsdpfn("run", "sft", f"run_dir={tmp_path / run_dir}", f"steps={steps}", *common)
        assert done.returncode == 0, done.stderr[-3000:]
    done = _fsdpfn("run", "sft", f"run_dir={tmp_path / 'b'}", "steps=4", *common, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    evaluated = {name: [r["step"] for r in rows(name) if "eval_loss" in r] for name in "ab"}
    assert evaluated["a"] == evaluated["b"] == [1, 2, 4], evaluated
    for r in rows("a"):
        assert (r["data_first"], r["data_last"], r["data_cursor"]) == (
            8 * (r["step"] - 1), 8 * r["step"] - 1, 8 * r["step"]), r
        assert 0 < r["elapsed"], r
    last = 0.0
    for r in rows("a"):
        spent = r["seconds"] + r.get("eval_seconds", 0.0)
        assert r["elapsed"] - last >= spent, (r["step"], r["elapsed"] - last, spent)
        last = r["elapsed"]
    assert all(("eval_seconds" in r) == ("eval_loss" in r) for r in rows("a"))
    assert all(r.get("checkpoint_seconds", 0) > 0 for r in rows("a") if r["step"] % 2 == 0)
    saved = {name: torch.load(tmp_path / name / "checkpoints" / "step_000004" / "rng" /
                              "rank_00000.pt", weights_only=False) for name in "ab"}
    assert torch.equal(saved["a"]["torch"], saved["b"]["torch"])
    assert repr(saved["a"]["python"]) == repr(saved["b"]["python"])
    # resuming the finished run below its step trains nothing: refused, the run left as it was
    before = (tmp_path / "a" / "config.yaml").read_text()
    refused = _fsdpfn("run", "sft", f"run_dir={tmp_path / 'a'}", "steps=3", *common, "--resume")
    assert refused.returncode != 0
    (line,) = _error_lines(refused.stderr)
    assert "steps: must be >= the step --resume continues from (4, " in line and \
        line.endswith("got 3; raise steps, or start a new run_dir"), line
    assert (tmp_path / "a" / "config.yaml").read_text() == before
