"""log.wandb: metrics rows reach a Weights & Biases run (offline mode: no network), read back
from the run's own record file; a resumed run continues the same W&B run."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes.config import WandbConfig
from fsdpfn.app.recipes.runtime import Metrics

wandb = pytest.importorskip("wandb", reason="log.wandb needs the wandb package "
                                            "(pip install 'fsdpfn[wandb]')")


def _records(run_file: Path) -> list:
    """The protobuf records of a .wandb file (a LevelDB-style log: a 7-byte file header, then
    records of crc32 (4 B), length (2 B), type (1 B), data, in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, out, pos, block = run_file.read_bytes(), [], 7, 32768
    payload = b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            out.append(record)
            payload = b""
    return out


def _complete(run_file: Path, timeout: float = 20.0) -> list:
    """The records of a run file once its exit record is there (wandb's service process
    writes the file after finish() returns)."""
    deadline = time.monotonic() + timeout
    while True:
        records = _records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) \
                or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _history(run_dir: Path) -> tuple[list[dict], list]:
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    rows, runs = [], []
    for f in files:
        for r in _complete(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in r.history.item})
            elif kind == "run":
                runs.append(r.run)
    return rows, runs


def test_metrics_rows_reach_an_offline_wandb_run(tmp_path):
    cfg = WandbConfig(project="fsdpfn-test", name="tiny", mode="offline")
    metrics = Metrics(tmp_path / "metrics.jsonl", wandb=cfg)
    for step, loss in ((1, 1.0), (2, 0.5), (3, 0.25)):
        metrics.write({"phase": "sft", "step": step, "loss": loss, "done": False, "note": "x"})
    metrics.close()
    rows, runs = _history(tmp_path)
    assert [r["sft/loss"] for r in rows] == [1.0, 0.5, 0.25]
    assert [r["sft/step"] for r in rows] == [1, 2, 3]
    assert not any("sft/done" in r or "sft/note" in r for r in rows)  # numbers only
    assert runs[0].project == "fsdpfn-test" and runs[0].display_name == "tiny"
    # the JSON lines are written as before
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [1.0, 0.5, 0.25]


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    cfg = WandbConfig(mode="offline")
    first = Metrics(tmp_path / "metrics.jsonl", wandb=cfg)
    first.write({"phase": "grpo", "step": 1, "reward_mean": 0.1})
    first.close()
    time.sleep(1.1)  # an offline run's directory is named by the second it starts
    resumed = Metrics(tmp_path / "metrics.jsonl", keep_until={"grpo": 1}, wandb=cfg)
    resumed.write({"phase": "grpo", "step": 2, "reward_mean": 0.2})
    resumed.close()
    rows, runs = _history(tmp_path)
    assert {r.run_id for r in runs} == {(tmp_path / "wandb" / "run_id").read_text()}
    assert runs[0].display_name == tmp_path.name  # name: null is the run_dir's name
    assert sorted(r["grpo/reward_mean"] for r in rows) == [0.1, 0.2], (
        rows, sorted(p.name for p in (tmp_path / "wandb").iterdir()))


def test_log_wandb_in_yaml():
    cfg = default_config("grpo", ["log.wandb.project=p", "log.wandb.mode=offline"])
    assert cfg.log.wandb == WandbConfig(project="p", name=None, mode="offline")
    assert default_config("grpo").log.wandb is None
    with pytest.raises(ConfigError, match=r"^log.wandb.mode: must be one of \['online', "
                                          r"'offline', 'disabled'\], got 'cloud'"):
        default_config("grpo", ["log.wandb.mode=cloud"])
