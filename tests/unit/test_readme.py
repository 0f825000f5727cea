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
