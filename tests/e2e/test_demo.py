"""The embedded GRPO demo end to end through the CLI (CPU): 2 trainer ranks over gloo, one
rollout server subprocess, weights pushed every step, checkpoints, --resume, metrics, PNG, and a
clean stop on SIGINT.

Shortened with command-line overrides: a 10-step SFT warm-up (no early stop), 8 problems x 8
answers per GRPO step, a checkpoint every 2 steps.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from cli_runs import fsdpfn, port_open  # tests/cli_runs.py

pytestmark = pytest.mark.dist

SHORT = ["warmup.steps=10", "warmup.target_reward=null", "prompts_per_step=8",
         "checkpoint.every=2", "eval.every=2", "eval.n_prompts=16", "log.every=1"]


def read_png(path: Path) -> tuple[int, int]:
    """Parse and check a PNG: signature, chunk CRCs, IHDR, and the IDAT size; (width, height)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"bad CRC in chunk {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    width, height, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    assert width > 100 and height > 100 and depth == 8, (width, height, depth)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    channels = {2: 3, 6: 4}[color]
    assert len(raw) == height * (1 + width * channels), "IDAT does not hold width x height pixels"
    return width, height


def metrics(run_dir: Path, phase: str = "grpo") -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == phase]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").iterdir()
                  if (p / "COMPLETE").is_file())


def check_rows(rows: list[dict]) -> None:
    for r in rows:
        for key in ("reward_mean", "loss", "kl", "tokens_per_s", "seconds"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert 0 < r["loss_tokens"] < r["tokens"], r  # the answers: fewer than the rows' tokens
    versions = [r["version"] for r in rows]
    assert all(b > a for a, b in zip(versions, versions[1:])), versions
    # the server generated each step with the weights pushed after the step before
    assert all(r["served_version"] == prev["version"] for prev, r in zip(rows, rows[1:])), rows


def documented_metrics() -> tuple[set[str], list[re.Pattern]]:
    """The keys docs/observability.md's metrics section and docs/api.md's step stats name
    (`rollout_rows_server{i}` as a pattern; `critic_*` and `time_*` as prefixes)."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "observability.md").read_text()
    names = set(re.findall(r"`([a-z_{}0-9*]+)`", text))
    api = (root / "docs" / "api.md").read_text().split("## Minibatches and stats")[1]
    names |= set(re.findall(r"`([a-z_{}0-9*]+)`", api.split("\n## ")[0]))
    patterns = [re.compile("^" + n.replace("{i}", r"\d+").replace("*", ".*") + "$")
                for n in names if "{i}" in n or "*" in n]
    return names, patterns


def check_documented(rows: list[dict]) -> None:
    """Every key of a metrics row is documented; a warm-up row states its tokens as an RL row
    does (they were dropped, leaving a tokens_per_s over a count no row named)."""
    names, patterns = documented_metrics()
    extra = {k for r in rows for k in r if k not in names and not any(p.match(k)
                                                                       for p in patterns)}
    assert not extra, sorted(extra)
    for r in rows:
        if r["phase"] == "warmup":
            assert 0 < r["loss_tokens"] < r["tokens"], r
            assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"]), r


@pytest.mark.timeout(300)
def test_demo_runs_resumes_and_plots(tmp_path):
    run_dir = tmp_path / "demo"
    first = fsdpfn("demo", f"run_dir={run_dir}", "steps=4", *SHORT)
    assert first.returncode == 0, first.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    check_rows(rows)
    assert all(r["behav_gap"] < 1e-3 for r in rows), [r["behav_gap"] for r in rows]
    assert checkpoint_steps(run_dir) == [2, 4]  # keep_last=2
    assert len(metrics(run_dir, "warmup")) == 10
    check_documented(metrics(run_dir) + metrics(run_dir, "warmup"))
    assert read_png(run_dir / "metrics.png")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["exit_code"] == 0
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "done" and state["exit_code"] == 0 and state["recipe"] == "grpo"
    assert "reward_mean" in first.stderr and "done in" in first.stderr

    # a second run into the same directory must not silently start over
    again = fsdpfn("demo", f"run_dir={run_dir}", "steps=4", *SHORT)
    assert again.returncode == 2 and "--resume" in again.stderr, again.stderr[-2000:]

    second = fsdpfn("demo", f"run_dir={run_dir}", "steps=6", *SHORT, "--resume")
    assert second.returncode == 0, second.stderr[-4000:]
    assert re.search(r"resumed from \S+step_000004 at step 4", second.stderr), second.stderr
    assert "warm-up (sft)" not in second.stderr  # the warm-up result is reused
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    check_rows(rows[4:])
    assert rows[4]["version"] > rows[3]["version"]  # load_checkpoint advanced the version
    assert checkpoint_steps(run_dir) == [4, 6]
    assert read_png(run_dir / "metrics.png")


@pytest.mark.timeout(300)
def test_sigint_stops_cleanly(tmp_path):
    """SIGINT to the launcher: the ranks finish their step and save it, the server is shut
    down, exit status 130, and --resume would continue from the saved step."""
    run_dir = tmp_path / "stop"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fsdpfn", "demo", f"run_dir={run_dir}",
                             "steps=200", "checkpoint.every=100", *SHORT[:3], "eval.every=0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").is_file() and metrics(run_dir):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-4000:]
    url = re.search(r"rollout server (http://[^\s;,]+)", err).group(1)
    assert not port_open(url), "the rollout server is still running"
    rows = metrics(run_dir)
    assert rows and rows[-1]["step"] < 200
    assert checkpoint_steps(run_dir) == [rows[-1]["step"]]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert "stopped" in err and "--resume" in err
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "interrupted" and state["exit_code"] == 130
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["exit_code"] == 130
    assert read_png(run_dir / "metrics.png")
