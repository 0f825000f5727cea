"""`fsdpfn run --resume` with the newest checkpoint corrupted, and what a run names as its
checkpoint (CPU, the SFT recipe on a tiny local model).

A run saves step_000002 and step_000004; two weights of step_000004 are negated in its shard, and
an unpublished ``step_000009.tmp-<token>`` (what a double Ctrl-C mid-save leaves) sits beside
them. The resumed run skips step_000004 with a warning naming it and the shard, resumes from
step_000002 (the data cursor with it), runs steps 3..6, and its summary and last lines name the
published step_000006, never the .tmp directory.

A save killed between writing its marker and renaming its directory leaves a complete
``step_000004.tmp-<token>`` owned by a dead process: --resume publishes it and continues from
step 4, not from step 2; a --dry-run --resume leaves it as it is.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from fsdpfn.testing.hf_dir import write_tiny_hf_dir

pytestmark = pytest.mark.dist


def _config(root: Path) -> Path:
    rows = [{"prompt": f"What is {i % 7}+{i % 5}?", "response": str(i % 7 + i % 5)}
            for i in range(60)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = write_tiny_hf_dir(root / "model", texts=[f"{r['prompt']} {r['response']}"
                                                     for r in rows], vocab_size=300)
    cfg = {"recipe": "sft", "steps": 4, "batch_size": 8, "checkpoint": {"every": 2},
           "model": {"path": str(model)},
           "data": {"train_files": [str(root / "train.jsonl")], "max_prompt_tokens": 64,
                    "max_response_tokens": 8},
           "launch": {"nproc": 1}, "log": {"plot": False}}
    (root / "sft.yaml").write_text(yaml.safe_dump(cfg))
    return root / "sft.yaml"


def _run(config: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(config),
                           f"run_dir={run_dir}", *args], capture_output=True, text=True,
                          timeout=200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def _negate_two_weights(ckpt: Path) -> str:
    """Flip the sign bits of two float32 words of the largest model chunk; returns its file."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    index, info = max(((i, s) for i, s in md.storage_data.items()
                       if i.fqn.startswith("model.") and i.fqn.endswith("weight")),
                      key=lambda x: x[1].length)
    data = bytearray((ckpt / info.relative_path).read_bytes())
    blob = bytes(data[info.offset:info.offset + info.length])
    chunk = torch.load(io.BytesIO(blob), weights_only=True).float()
    start = info.offset + blob.index(chunk.contiguous().view(-1)[:16].numpy().tobytes())
    for word in (4, 6):
        data[start + 4 * word + 3] ^= 0x80
    (ckpt / info.relative_path).write_bytes(bytes(data))
    return info.relative_path


@pytest.mark.timeout(400)
def test_resume_skips_a_corrupted_newest_checkpoint_and_names_only_published_ones(tmp_path):
    config, run_dir = _config(tmp_path), tmp_path / "run"
    _run(config, run_dir)
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000004"]
    shard = _negate_two_weights(ckpts / "step_000004")
    leftover = ckpts / f"step_000009.tmp-{uuid.uuid4().hex}"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half a save")
    proc = _run(config, run_dir, "steps=6", "--resume")
    err = proc.stderr
    assert "skipping" in err and str(ckpts / "step_000004") in err and shard in err, err[-3000:]
    assert f"resumed from {ckpts / 'step_000002'} at step 2" in err, err[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["data_cursor"] for r in rows] == [8, 16, 24, 32, 40, 48]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoint"] == str(ckpts / "step_000006")
    assert ".tmp-" not in err.strip().splitlines()[-1] and "step_000006" in err, err[-1000:]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.timeout(400)
def test_resume_publishes_a_save_killed_between_its_marker_and_its_rename(tmp_path):
    import socket

    config, run_dir = _config(tmp_path), tmp_path / "run"
    _run(config, run_dir)
    ckpts = run_dir / "checkpoints"
    cut = ckpts / f"step_000004.tmp-{uuid.uuid4().hex}"
    os.rename(ckpts / "step_000004", cut)  # as publish_dir leaves it, killed before its rename
    (cut / "OWNER").write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid()}))
    before = sorted(p.name for p in ckpts.iterdir())
    _run(config, run_dir, "steps=6", "--resume", "--dry-run")
    assert sorted(p.name for p in ckpts.iterdir()) == before  # a dry run changes nothing
    err = _run(config, run_dir, "steps=6", "--resume").stderr
    assert "interrupted while publishing it is finished" in err, err[-3000:]
    assert f"resumed from {ckpts / 'step_000004'} at step 4" in err, err[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["data_cursor"] for r in rows] == [8, 16, 24, 32, 40, 48]
    assert not any(".tmp-" in p.name for p in ckpts.iterdir())
    assert not (ckpts / "step_000004" / "OWNER").exists()
