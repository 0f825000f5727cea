"""Every ```python and ```yaml block of README.md and docs/*.md runs.

YAML blocks pass ``fsdpfn run FILE --dry-run`` (validation and the preflight: data columns,
reward signature, rows against the model's positions) in a directory holding what they name
(data/train.jsonl, data/test.jsonl, my_rewards.py), with ``model.path`` swapped for a tiny model
directory where they set one. A block without a ``recipe:`` key is a fragment, checked inside the
recipe named by ``<!-- snippet: recipe NAME -->`` above it.

Python blocks execute on the CPU, a page's blocks in order in one namespace (so a page may build
on its earlier blocks), all pages in one fresh process. ``<!-- snippet: setup NAME -->`` above a
block first runs the named setup of SETUPS (a page that shows fragments of a loop gets a tiny
actor, a batch and a target to run them on).

A block that cannot run on a CPU is marked ``<!-- snippet: skip (why) -->`` right above it; the
skips are listed in SKIPS below so that they stay few and deliberate.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# (page, language, first line of the block): every skipped block, with the reason in the page
SKIPS = {
    ("docs/api.md", "python", "mesh  = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=2, cp=1))"),
    ("docs/parallelism.md", "python", "mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=8))"),
    # the fastest settings measured: logprobs_impl liger needs a CUDA trainer, refused on a CPU
    ("docs/parallelism.md", "yaml", "engine:"),
}
# pages whose blocks all take a setup without a marker (pages edited by others as a whole)
PAGE_SETUP = {"docs/observability.md": "tiny-actor"}

SETUPS = {
    "tiny-actor": '''
import tempfile
import fsdpfn as ff
from fsdpfn.testing import random_batch, tiny_qwen2_config
mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1))
actor = ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config(), dtype="float32",
                                       optimizer=ff.OptimizerConfig(lr=1e-5)), mesh)
batch = ff.compute_advantages(random_batch(8, 24, group_size=4),
                              ff.AdvantageConfig(estimator="grpo", group_size=4))
ppo_config = ff.PPOConfig()
target = ff.DiskTarget(tempfile.mkdtemp())
''',
}

_BLOCK = re.compile(r"(?:<!--\s*snippet:\s*(?P<mark>.*?)\s*-->\s*\n)?```(?P<lang>python|yaml)\n"
                    r"(?P<code>.*?)```", re.S)


def blocks():
    """[(page, index, lang, code, mark)] of every python and yaml block."""
    out = []
    for page in PAGES:
        rel = str(page.relative_to(ROOT))
        for i, m in enumerate(_BLOCK.finditer(page.read_text())):
            out.append((rel, i, m["lang"], m["code"], m["mark"] or ""))
    return out


def _first_line(code: str) -> str:
    """The first line of code, its comment left out."""
    return next((line.split("#")[0].strip() for line in code.splitlines()
                 if line.split("#")[0].strip()), "")


def test_the_skips_are_the_listed_ones():
    marked = {(page, lang, _first_line(code)) for page, _, lang, code, mark in blocks()
              if mark.startswith("skip")}
    assert marked == SKIPS, ("a skip marker was added or removed: update SKIPS (and keep skips "
                             "few)", marked ^ SKIPS)
    for page, _, lang, code, mark in blocks():
        if mark.startswith("skip"):
            assert re.fullmatch(r"skip \(.+\)", mark), (page, mark, "say why it is skipped")


def test_snippets_exist_on_every_user_page():
    pages = {page for page, *_ in blocks()}
    for name in ("README.md", "docs/getting-started.md", "docs/parallelism.md",
                 "docs/rollout.md"):
        assert name in pages, name


# ---------------------------------------------------------------- YAML: a dry run each

ROWS = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i), "response": str(2 * i),
         "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(8)]
REWARD = ("def score(prompt, completion, *, answer, sample, **kwargs):\n"
          "    return float(str(answer) in completion)\n")


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """What the YAML blocks name, made real: data files, my_rewards.py, a tiny model directory
    (with room for 512 + 1,024 positions)."""
    from fsdpfn.testing.hf_dir import write_tiny_hf_dir

    root = tmp_path_factory.mktemp("docs_user")
    (root / "data").mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (root / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "my_rewards.py").write_text(REWARD)
    model = write_tiny_hf_dir(root / "model", texts=[r["prompt"] for r in ROWS], vocab_size=300)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (model / "config.json").write_text(json.dumps(config))
    return root


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _yaml_file(code: str, mark: str, path: Path) -> list[str]:
    """Write the block as a config file; the overrides that go with it."""
    import yaml

    data = yaml.safe_load(code)
    assert isinstance(data, dict), "a YAML block must be a mapping"
    if "recipe" not in data:
        m = re.fullmatch(r"recipe (\w+)", mark)
        assert m, "a YAML fragment (no recipe: key) needs <!-- snippet: recipe NAME -->"
        code = f"recipe: {m[1]}\n{code}"
    path.write_text(code)
    return [f"model.path={path.parent / 'model'}"] if (data.get("model") or {}).get("path") \
        else []


@pytest.mark.timeout(120)
def test_every_yaml_block_passes_a_dry_run(user_dir, monkeypatch):
    from fsdpfn.app.cli import main

    monkeypatch.chdir(user_dir)
    monkeypatch.syspath_prepend(str(user_dir))
    checked = 0
    for page, i, lang, code, mark in blocks():
        if lang != "yaml" or mark.startswith("skip"):
            continue
        path = user_dir / f"{page.replace('/', '_')}_{i}.yaml"
        overrides = _yaml_file(code, mark, path)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["run", str(path), "--dry-run", *overrides])
        if "wandb:" in code and not _has("wandb"):
            # wandb is in the test extra; where it is missing, the block's refusal is the check
            assert rc == 2 and "log.wandb: needs the wandb package" in err.getvalue(), \
                (page, i, err.getvalue()[-3000:])
            continue
        assert rc == 0, (page, i, err.getvalue()[-3000:])
        assert "recipe:" in out.getvalue() and "trainer:" in err.getvalue(), (page, i)
        checked += 1
    assert checked >= 3


# ---------------------------------------------------------------- Python: one process

RUNNER = r'''
import json, sys, traceback
jobs = json.load(open(sys.argv[1]))
setups = json.load(open(sys.argv[2]))
failed = []
for page, blocks in jobs.items():
    ns = {"__name__": "__snippet__"}
    done = set()
    for index, code, setup in blocks:
        try:
            if setup and setup not in done:
                exec(compile(setups[setup], f"<setup {setup}>", "exec"), ns)
                done.add(setup)
            exec(compile(code, f"<{page} block {index}>", "exec"), ns)
        except BaseException:
            failed.append(f"{page} block {index}:\n{traceback.format_exc()}")
            break
print("SNIPPETS_FAILED" if failed else "SNIPPETS_OK")
print("\n".join(failed))
'''


@pytest.mark.timeout(180)
def test_every_python_block_runs(tmp_path):
    jobs: dict[str, list] = {}
    for page, i, lang, code, mark in blocks():
        if lang != "python" or mark.startswith("skip"):
            continue
        m = re.fullmatch(r"setup ([\w-]+)", mark)
        setup = m[1] if m else PAGE_SETUP.get(page)
        assert setup is None or setup in SETUPS, (page, i, setup)
        jobs.setdefault(page, []).append((i, code, setup))
    assert sum(map(len, jobs.values())) >= 4
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "setups.json").write_text(json.dumps(SETUPS))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="")  # a plain one-rank CPU process
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "jobs.json"),
                           str(tmp_path / "setups.json")], capture_output=True, text=True,
                          timeout=170, cwd=tmp_path, env=env)
    assert "SNIPPETS_OK" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
