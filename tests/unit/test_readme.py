"""The README's test command is the one CI runs, and its main command names a real entry point."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks[:2] for line in block.strip().splitlines()]


def test_ci_runs_the_readme_test_command():
    main_cmd, test_cmd = _readme_commands()[:2]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines(), (test_cmd, ci)
    assert "pip install -q torch==2.13.0" in test_cmd and "pytest" in test_cmd
    assert "pip install -q torch==2.13.0" in main_cmd and "fsdpfn demo" in main_cmd


# ---------------------------------------------------------------- YAML and the API page

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import attrs  # noqa: E402
import pytest  # noqa: E402

ROWS = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(8)]
REWARD = ("def score(prompt, completion, *, answer, sample, **kwargs):\n"
          "    return float(str(answer) in completion)\n")


def _readme_yaml() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """What the README's YAML names, made real: data/train.jsonl and data/test.jsonl, the
    my_rewards module, and a tiny model directory (with room for 512 + 1,024 positions)."""
    from fsdpfn.testing.hf_dir import write_tiny_hf_dir

    root = tmp_path_factory.mktemp("readme_user")
    (root / "data").mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (root / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "my_rewards.py").write_text(REWARD)
    model = write_tiny_hf_dir(root / "model", texts=[r["prompt"] for r in ROWS], vocab_size=300)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (model / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.timeout(120)
def test_every_readme_yaml_passes_a_dry_run(user_dir):
    """Each YAML block of the README, written to a file as it stands, validates and passes the
    preflight (data columns, reward signature, positions) with `fsdpfn run --dry-run`; only the
    model directory is swapped for a tiny one."""
    blocks = _readme_yaml()
    assert blocks, "the README shows a YAML config"
    for i, text in enumerate(blocks):
        path = user_dir / f"readme_{i}.yaml"
        path.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(path), "--dry-run",
                               f"model.path={user_dir / 'model'}"], capture_output=True,
                              text=True, timeout=100, cwd=user_dir,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, (i, proc.stderr[-3000:])
        assert "recipe:" in proc.stdout and "[fsdpfn] trainer:" in proc.stderr


def test_api_page_is_linked_and_names_the_public_surface():
    import fsdpfn as ff

    text = (ROOT / "docs" / "api.md").read_text()
    assert "](docs/api.md)" in (ROOT / "README.md").read_text()
    assert text.startswith("# fsdpfn public API contract")
    missing = [name for name in ff.__all__
               if f"`{name}" not in text and f"fsdpfn.{name}" not in text]
    assert not missing, f"docs/api.md does not name {missing}"
    fields = [a.name for a in attrs.fields(ff.EngineConfig)]
    missing = [f for f in fields if f"`{f}`" not in text]
    assert not missing, f"docs/api.md's EngineConfig table lacks {missing}"
