"""Recipe checkpoints saved asynchronously (``checkpoint.async_save``, the default): exact, and a
crash mid-save leaves the last published checkpoint (CPU, the SFT recipe on a tiny local model).

* One state saved synchronously and asynchronously (the state stepping on while the async write
  runs) loads the same tensors, RNG files and manifest (dp=2, gloo).
* A run with async_save true and one with false produce the same metrics and the same final
  checkpoint, tensor for tensor.
* A run whose step-4 save is held in flight (FSDPFN_TEST_SAVE_DELAY) is killed there with
  SIGKILL of its launcher: step_000002 is the newest published checkpoint, step_000004 exists
  only as its unpublished .tmp directory, and ``--resume`` continues from step 2 to the same
  metrics and final checkpoint as the run never interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from tensordict import TensorDict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdpfn.testing.hf_dir import write_tiny_hf_dir

pytestmark = pytest.mark.dist

EXACT = ("loss", "grad_norm", "tokens", "data_cursor", "eval_loss", "eval_p_correct")


# ---------------------------------------------------------------- helpers


def _loaded(ckpt: Path, out: Path) -> dict:
    """Every tensor and value a checkpoint holds (model, optimizer), read back by DCP."""
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def _same_values(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors: dtype, shape and every bit)."""
    bad = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = a[key], b[key]
        if isinstance(x, dict):
            bad += [f"{key}.{k}" for k in _same_values(x, y)]
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                bad.append(key)
        elif x != y:
            bad.append(key)
    return bad


def _manifest(ckpt: Path) -> dict:
    """The manifest but for the time of the save and DCP's .metadata (which records the
    directory it was written to and a save id)."""
    m = json.loads((ckpt / "fsdpfn.json").read_text())
    del m["files"][".metadata"], m["checksums"]["files"][".metadata"]
    return {k: v for k, v in m.items() if k not in ("saved_at", "manifest_crc32")}


# ---------------------------------------------------------------- one state, two saves


def _steps(state, n: int):
    import fsdpfn as ff

    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, 128, (4, 12), generator=g)
        mask = torch.ones(4, 12, dtype=torch.bool)
        loss = mask.clone()
        loss[:, 0] = False  # the first token has no log-prob
        batch = TensorDict({"input_ids": ids, "attention_mask": mask, "loss_mask": loss},
                           batch_size=[4])
        state, _ = ff.sft_step(state, batch, ff.SFTConfig())
    return state


def _sync_and_async(root):
    import fsdpfn as ff
    from fsdpfn.checkpoint import save_checkpoint
    from fsdpfn.testing import tiny_qwen2_config

    root = Path(root)
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          optimizer=ff.OptimizerConfig(lr=1e-2), seed=1)
    state = ff.shard_model(cfg, ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu"))
    state = _steps(state, 2)
    save_checkpoint(state, root / "sync", extra={"k": 1})
    first = save_checkpoint(state, root / "async", extra={"k": 1}, async_save=True)
    # a second async save ordered after the first: it publishes only once the first did
    second = save_checkpoint(state, root / "after", extra={"k": 1}, async_save=True,
                             publish_after=first)
    state = _steps(state, 2)  # parameters and moments change while the writes run
    second.wait()
    ordered = first.published and first.finished_at <= second.finished_at
    first.wait()
    return ordered


@pytest.mark.timeout(120)
def test_sync_and_async_saves_of_one_state_load_identical(spmd2, tmp_path):
    for ordered in spmd2.run(_sync_and_async, args=(str(tmp_path),), timeout=100):
        assert ordered
    sync = _loaded(tmp_path / "sync", tmp_path / "sync.pt")
    assert any(k.startswith("optim.") for k in _flat_keys(sync)), "no optimizer state saved"
    for name in ("async", "after"):
        assert _same_values(sync, _loaded(tmp_path / name, tmp_path / f"{name}.pt")) == []
        assert _manifest(tmp_path / name) == _manifest(tmp_path / "sync")
        for rank in (0, 1):
            rng = f"rng/rank_{rank:05d}.pt"
            assert (tmp_path / name / rng).read_bytes() == (tmp_path / "sync" / rng).read_bytes()


def _flat_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


# ---------------------------------------------------------------- the recipe


def _config(root: Path) -> Path:
    rows = [{"prompt": f"What is {i % 7}+{i % 5}?", "response": str(i % 7 + i % 5)}
            for i in range(60)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = write_tiny_hf_dir(root / "model", texts=[f"{r['prompt']} {r['response']}"
                                                     for r in rows], vocab_size=300)
    cfg = {"recipe": "sft", "steps": 6, "batch_size": 8, "eval_every": 3,
           "checkpoint": {"every": 2, "keep_last": 3}, "export": False,
           "model": {"path": str(model)},
           "data": {"train_files": [str(root / "train.jsonl")],
                    "eval_files": [str(root / "train.jsonl")], "eval_size": 8,
                    "max_prompt_tokens": 64, "max_response_tokens": 8},
           "launch": {"nproc": 1}, "log": {"plot": False, "progress": False}}
    (root / "sft.yaml").write_text(yaml.safe_dump(cfg))
    return root / "sft.yaml"


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _run(config: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(config),
                           f"run_dir={run_dir}", *args], capture_output=True, text=True,
                          timeout=200, env=_env())
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _exact(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("step", *EXACT) if k in r} for r in rows]


def _published(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir()
                  if (p / "COMPLETE").is_file())


def _kill_mid_save(config: Path, run_dir: Path, log: Path) -> list[Path]:
    """Run with step 4's async save held 60 s before publishing; SIGKILL the launcher once step
    4's save is in flight (its .tmp directory exists); the .tmp directories left."""
    with open(log, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "fsdpfn", "run", str(config),
                                     f"run_dir={run_dir}"], stdout=out, stderr=subprocess.STDOUT,
                                    env=_env(FSDPFN_TEST_SAVE_DELAY="step_000004=60"))
        try:
            deadline = time.monotonic() + 150
            while not list((run_dir / "checkpoints").glob("step_000004.tmp-*")):
                assert launcher.poll() is None and time.monotonic() < deadline, \
                    log.read_text()[-3000:]
                time.sleep(0.05)
            ranks = [int(p.read_text()) for p in (run_dir / ".ranks").glob("rank*.pid")]
            launcher.send_signal(signal.SIGKILL)
            launcher.wait(timeout=10)
            deadline = time.monotonic() + 15
            while any(Path(f"/proc/{pid}").exists() for pid in ranks):
                assert time.monotonic() < deadline, "a rank outlived its SIGKILLed launcher"
                time.sleep(0.1)
        finally:
            launcher.kill()
    return sorted((run_dir / "checkpoints").glob("*.tmp-*"))


@pytest.mark.timeout(400)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the pids")
def test_async_saves_are_exact_and_a_kill_mid_save_resumes_from_the_last_published(tmp_path):
    config = _config(tmp_path)
    ref_dir, async_dir, killed_dir = (tmp_path / n for n in ("sync", "async", "killed"))
    _run(config, ref_dir, "checkpoint.async_save=false")
    _run(config, async_dir)  # checkpoint.async_save: true by default
    ref, rows = _rows(ref_dir), _rows(async_dir)

    # 1. equivalence: the same metrics, checkpoints and final state as the synchronous run
    assert _exact(rows) == _exact(ref)
    assert _published(async_dir) == _published(ref_dir) == \
        ["step_000002", "step_000004", "step_000006"]
    for name in _published(ref_dir):  # every checkpoint, async against sync, loads the same
        ref_ckpt = _loaded(ref_dir / "checkpoints" / name, tmp_path / f"ref_{name}.pt")
        assert _same_values(ref_ckpt, _loaded(async_dir / "checkpoints" / name,
                                              tmp_path / f"async_{name}.pt")) == [], name
    final = ref_ckpt  # step_000006
    # the rows: seconds blocked on every save; a row names a checkpoint once it is published
    saved = [r for r in rows if "checkpoint_seconds" in r]
    assert [r["step"] for r in saved] == [2, 4, 6]
    assert all(r["checkpoint_copy_bytes"] > 0 for r in saved[:2])
    named = [r for r in rows if "checkpoint" in r]  # the newest published by the row's end
    names = [Path(r["checkpoint"]).name for r in named]
    assert names == sorted(set(names)) and set(names) <= set(_published(async_dir))
    assert names[-1] == "step_000006" and named[-1]["step"] == 6
    assert all(r["checkpoint_write_seconds"] > 0 for r in named)
    # every published checkpoint is named by some row (step 4's, in flight while step 6's
    # final save is written directly, by step 6's row beside it)
    every = {Path(p).name for r in rows for p in r.get("checkpoints_published", ())} | set(names)
    assert every == set(_published(async_dir))
    # a step's seconds include the save it was blocked by; its step stats are in the row
    assert all(r["seconds"] >= r["checkpoint_seconds"] > 0 for r in saved)
    assert all({"time_total", "time_forward", "lr", "peak_memory_gb"} <= set(r) for r in rows)

    # 2. a SIGKILL while step 4's save is in flight: step 2 is the last published checkpoint
    leftovers = _kill_mid_save(config, killed_dir, tmp_path / "killed.log")
    assert _published(killed_dir) == ["step_000002"]
    assert [p.name.split(".tmp-")[0] for p in leftovers] == ["step_000004"]
    resumed = _run(config, killed_dir, "--resume")
    assert "resumed from" in resumed.stderr and "step_000002 at step 2" in resumed.stderr
    assert _exact(_rows(killed_dir)) == _exact(ref)
    assert _published(killed_dir) == ["step_000002", "step_000004", "step_000006"]
    assert not list((killed_dir / "checkpoints").glob("*.tmp-*"))
    assert _same_values(final, _loaded(killed_dir / "checkpoints" / "step_000006",
                                       tmp_path / "killed.pt")) == []
    summary = json.loads((killed_dir / "summary.json").read_text())
    assert summary["checkpoint"] == str(killed_dir / "checkpoints" / "step_000006")
