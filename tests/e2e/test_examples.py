"""Every example in examples/ runs a few steps on CPU (subprocess, overrides on the command
line) and exits 0; every example YAML validates against its recipe's config class."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpfn import serde
from fsdpfn.app.cli import main
from fsdpfn.app.recipes import RECIPE_CONFIGS, default_config, load_recipe_config

pytestmark = pytest.mark.dist

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# a few steps each; RL examples with a short warm-up
QUICK = {
    "grpo.yaml": ["steps=2", "warmup.steps=10", "warmup.target_reward=null",
                  "prompts_per_step=4", "eval.every=0"],
    "ppo.yaml": ["steps=2", "warmup.steps=10", "warmup.target_reward=null",
                 "prompts_per_step=8"],
    "sft.yaml": ["steps=3", "eval_every=2"],
    "rw.yaml": ["steps=3"],
    "dpo.yaml": ["steps=3"],
}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(60)
def test_every_example_yaml_is_valid_and_headed():
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert names == sorted(QUICK), names
    for name in names:
        text = (EXAMPLES / name).read_text()
        assert text.startswith("#") and "fsdpfn run examples/" + name in text, name
        cfg = load_recipe_config(EXAMPLES / name)
        assert cfg.recipe == name.removesuffix(".yaml")


@pytest.fixture(scope="module")
def tiny_user(tmp_path_factory):
    """A tiny model directory (room for 512 + 1,024 positions) and math data in its place."""
    from fsdpfn.testing.hf_dir import write_tiny_hf_dir

    root = tmp_path_factory.mktemp("gpu_examples")
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(8)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = write_tiny_hf_dir(root / "model", texts=[r["prompt"] for r in rows], vocab_size=300)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (model / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", sorted((EXAMPLES / "gpu").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_gpu_example_passes_a_dry_run(path, tiny_user, tmp_path):
    """A GPU example as written, its model directory and data swapped for tiny local ones:
    the config validates and the preflight (data columns, reward, positions) passes."""
    text = path.read_text()
    assert text.startswith("#") and f"fsdpfn run examples/gpu/{path.name}" in text
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(path), "--dry-run",
                           f"model.path={tiny_user / 'model'}",
                           f"data.train_files=[{tiny_user / 'train.jsonl'}]",
                           f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=100, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[fsdpfn] trainer:" in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_cli_help_config_and_errors(capsys, tmp_path):
    for argv in (["--help"], ["run", "--help"], ["demo", "--help"], ["config", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        assert "usage: fsdpfn" in capsys.readouterr().out
    # `fsdpfn config NAME` prints a complete config that loads back unchanged
    for name in RECIPE_CONFIGS:
        assert main(["config", name, "steps=7"]) == 0
        path = tmp_path / f"{name}.yaml"
        path.write_text(capsys.readouterr().out)
        assert load_recipe_config(path) == default_config(name, ["steps=7"])
    # bad values and unknown keys: exit status 2, the dotted key named, nothing started
    assert main(["demo", "ppo.clip_low=2", "--dry-run"]) == 2
    assert "ppo.clip_low: must be < 1, got 2" in capsys.readouterr().err
    assert main(["run", str(EXAMPLES / "sft.yaml"), "optimizer.lrr=1", "--dry-run"]) == 2
    assert "unknown key(s) ['lrr']" in capsys.readouterr().err
    assert main(["demo", f"run_dir={tmp_path / 'd'}", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert serde.from_yaml(out.out, RECIPE_CONFIGS["grpo"]).run_dir == str(tmp_path / "d")
    assert "trainer: 2 rank(s) (<rank> = 0..1): RANK=<rank> LOCAL_RANK=<rank> WORLD_SIZE=2" \
        in out.err and "-m fsdpfn.app.recipes.worker --config" in out.err
    assert not (tmp_path / "d").exists()


# each bad input: (file text or None for examples/sft.yaml, overrides, what the one line says)
CLI_ERRORS = [
    ("recipe: sft\nsteps: 3\noptimizer:\n  lr: 1\n    eps: 2\n", [],
     "YAML syntax error at line 5, column 8: mapping values are not allowed here"),
    ("recipe: sft\nsteps: 3\nsteps: 4\n", [],
     "duplicate key 'steps' at line 3, column 1 (first at line 2, column 1): a key may appear "
     "once per mapping"),
    (None, ["optimizer=5"], "optimizer: must be a mapping (section), got 5"),
    (None, ["launch=null"], "launch: must be a mapping (section), got None"),
    (None, ["run_dir={tmp}/a_file"], "run_dir: must be a directory (or a path to create), got "
                                     "'{tmp}/a_file', which is a file"),
    (None, ["parallel.tp=3", "launch.nproc=2", "launch.device=cpu"],
     "parallel.tp: tp x cp = 3 x 1 = 3 must divide the 2 trainer ranks (launch.nproc), got "
     "tp=3"),
    (None, ["parallel.dp=3", "launch.nproc=2", "launch.device=cpu"],
     "parallel.dp: dp x cp x tp = 3 x 1 x 1 = 3 must equal the 2 trainer ranks "
     "(launch.nproc), got dp=3"),
    (None, ["steps=[1"], "override 'steps=[1': YAML syntax error at line 1, column 3"),
    (None, ["steps", "--dry-run"], "override 'steps': must be KEY=VALUE (a dotted key, a YAML "
                                   "value: steps=10 optimizer.lr=1e-6) ('fsdpfn run --help'"),
    (None, ["--dry-rn"], "unrecognized arguments: --dry-rn ('fsdpfn run --help' shows"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text,overrides,expected", CLI_ERRORS,
                         ids=["yaml-syntax", "duplicate-key", "section-scalar", "section-null",
                              "run-dir-file", "tp-vs-nproc", "dp-vs-nproc", "override-syntax",
                                  "override-without-equals", "flag-misspelt"])
def test_cli_errors_are_one_line_exit_2_before_any_rank(text, overrides, expected, tmp_path):
    """Each bad input: exit status 2, one line naming the key, the rule and the value, no
    traceback, and nothing started (no run_dir written)."""
    (tmp_path / "a_file").write_text("")
    config = EXAMPLES / "sft.yaml"
    if text is not None:
        config = tmp_path / "bad.yaml"
        config.write_text(text)
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    run_dir = tmp_path / "run"
    if not any(o.startswith("run_dir=") for o in overrides):
        overrides.append(f"run_dir={run_dir}")
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(config), *overrides],
                          capture_output=True, text=True, timeout=100, env=_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("fsdpfn: error: "), \
        proc.stderr
    assert expected.replace("{tmp}", str(tmp_path)) in proc.stderr, proc.stderr
    assert not run_dir.exists()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(QUICK))
def test_example_runs(name, tmp_path):
    run_dir = tmp_path / name.removesuffix(".yaml")
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(EXAMPLES / name),
                           f"run_dir={run_dir}", *QUICK[name]],
                          capture_output=True, text=True, timeout=140, env=_env())
    server_log = run_dir / "rollout.log"
    assert proc.returncode == 0, (proc.stderr[-6000:] + "\n--- rollout.log ---\n"
                                  + (server_log.read_text()[-2000:] if server_log.is_file()
                                     else "(none)"))
    recipe = name.removesuffix(".yaml")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["phase"] == recipe]
    assert steps == list(range(1, len(steps) + 1)) and steps, steps
    assert (run_dir / "metrics.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(150)
def test_custom_loop_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "custom_loop.py"), "--steps", "2",
                           "--warmup-steps", "5", "--prompts", "4",
                           "--run-dir", str(tmp_path / "custom")],
                          capture_output=True, text=True, timeout=140, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("reward") == 2, proc.stdout
    assert (tmp_path / "custom" / "checkpoints" / "step_2" / "COMPLETE").is_file()
