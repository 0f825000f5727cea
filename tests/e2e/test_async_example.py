"""examples/async_loop.py runs as written: generation ahead of training within the bound."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "async_loop.py"


@pytest.mark.timeout(240)
def test_async_loop_trains_within_the_staleness_bound(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "4", "--max-staleness", "2",
                           "--prompts", "8", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=220,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = re.findall(r"^step +(\d+) .*staleness mean ([\d.]+) max (\d+)", proc.stdout, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4], proc.stdout
    assert all(int(r[2]) <= 2 for r in rows), rows
    assert int(rows[0][2]) == 0 and max(int(r[2]) for r in rows) >= 1, rows  # it ran ahead
