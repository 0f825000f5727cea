"""The manifest's own check and resuming from the newest intact checkpoint (CPU, gloo).

* one flipped bit of fsdpfn.json (extra.step 4 -> 6, the state's step, the key "checksums") is a
  CheckpointError naming the manifest, from load_checkpoint and from check_checkpoint; a manifest
  without its CRC (an older fsdpfn's) is refused unless verify=False;
* a run_dir holding two real checkpoints, the newest corrupted (a data shard, or its manifest):
  latest_intact_checkpoint skips it with a warning naming it and why, and the older one loads;
  with fallback=False the error names the bad file and the call that falls back; all of them
  corrupted is an error listing each.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn.checkpoint import (MANIFEST, check_checkpoint, latest_intact_checkpoint,
                               load_checkpoint, save_checkpoint)
from fsdpfn.errors import CheckpointError
from fsdpfn.testing import tiny_qwen2_config

pytestmark = pytest.mark.dist


def _state(seed=1):
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          optimizer=ff.OptimizerConfig(lr=1e-2), seed=seed)
    return ff.shard_model(cfg, ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu"))


def _steps(state, n):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, 128, (4, 10), generator=g)
        mask = torch.ones(4, 10, dtype=torch.bool)
        loss = mask.clone()
        loss[:, 0] = False
        batch = TensorDict({"input_ids": ids, "attention_mask": mask, "loss_mask": loss},
                           batch_size=[4])
        state, _ = ff.sft_step(state, batch, ff.SFTConfig())
    return state, None


def _negate_q_proj_pair(root: Path, rel: str) -> str:
    """Negate two float32 weights of a q_proj chunk in ``root / rel`` (sign bits of words 4 and
    6 of its data). Returns the chunk's key."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(root)).read_metadata()
    index, info = next((i, s) for i, s in sorted(md.storage_data.items(), key=lambda x: x[0].fqn)
                       if s.relative_path == rel and i.fqn.startswith("model.")
                       and i.fqn.endswith("q_proj.weight"))
    data = bytearray((root / rel).read_bytes())
    blob = bytes(data[info.offset:info.offset + info.length])
    chunk = torch.load(io.BytesIO(blob), weights_only=True)
    start = info.offset + blob.index(chunk.contiguous().view(-1)[:16].numpy().tobytes())
    for word in (4, 6):
        data[start + 4 * word + 3] ^= 0x80
    (root / rel).write_bytes(bytes(data))
    return index.fqn


def _flip_bit(file: Path, needle: str, char_index: int, bit: int) -> None:
    """Flip one bit of the character at ``char_index`` of the first ``needle`` in ``file``."""
    text = file.read_bytes()
    at = text.index(needle.encode()) + char_index
    file.write_bytes(text[:at] + bytes([text[at] ^ (1 << bit)]) + text[at + 1:])


def _save_two(root):
    """run_dir/checkpoints/step_000002 and step_000004, saved after 2 and 4 SFT steps."""
    root = Path(root)
    state, _ = _steps(_state(), 2)
    save_checkpoint(state, root / "step_000002", extra={"step": 2})
    state, _ = _steps(state, 2)
    save_checkpoint(state, root / "step_000004", extra={"step": 4})
    return state.step


def _load_all(paths):
    """{path: ("ok", extra, step) or ("error", message)} loading each into a fresh state."""
    out = {}
    for path in paths:
        try:
            state, extra = load_checkpoint(_state(seed=5), path)
            out[path] = ("ok", extra, state.step)
        except CheckpointError as exc:
            out[path] = ("error", str(exc))
    try:
        load_checkpoint(_state(seed=5), paths[-1], verify=False)
        out["unverified"] = "ok"
    except CheckpointError as exc:
        out["unverified"] = str(exc)
    return out


@pytest.mark.timeout(360)
def test_one_flipped_bit_of_the_manifest_is_refused_naming_it(spmd1, tmp_path):
    src = tmp_path / "src"
    spmd1.run(_save_two, args=(str(src),), timeout=150)
    good = src / "step_000004"
    manifest = json.loads((good / MANIFEST).read_text())
    assert manifest["extra"] == {"step": 4} and manifest["step"] == 4
    flips = {"extra_step": ('"extra": {\n  "step": 4', len('"extra": {\n  "step": '), 1),  # 4->6
             "state_step": ('\n "step": 4', len('\n "step": '), 0),  # 4 -> 5
             "checksums_key": ('"checksums"', 3, 0),  # "checksums" -> "chdcksums"
             "old_format": None}
    for name, flip in flips.items():
        shutil.copytree(good, tmp_path / name)
        if flip is not None:
            _flip_bit(tmp_path / name / MANIFEST, *flip)
    old = tmp_path / "old_format" / MANIFEST
    unsealed = {k: v for k, v in json.loads(old.read_text()).items() if k != "manifest_crc32"}
    old.write_text(json.dumps(dict(unsealed, format_version=1), indent=1))
    paths = [str(good)] + [str(tmp_path / n) for n in flips]
    out = spmd1.run(_load_all, args=(paths,), timeout=150)[0]
    assert out[str(good)] == ("ok", {"step": 4}, 4)
    for name in ("extra_step", "state_step", "checksums_key"):
        verdict = out[str(tmp_path / name)]
        assert verdict[0] == "error" and f"{tmp_path / name / MANIFEST}'" in verdict[1] \
            and "the manifest is corrupted" in verdict[1], (name, verdict)
        with pytest.raises(CheckpointError, match="^check_checkpoint: .*the manifest is "
                                                  "corrupted"):
            check_checkpoint(tmp_path / name)
    # a corrupted .metadata is named by the function called (it said load_checkpoint:)
    shutil.copytree(good, tmp_path / "metadata")
    meta = tmp_path / "metadata" / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 1
    meta.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"^check_checkpoint: .*\.metadata'?: its CRC32"):
        check_checkpoint(tmp_path / "metadata")
    verdict = out[str(tmp_path / "old_format")]
    assert verdict[0] == "error" and "must carry manifest_crc32" in verdict[1], verdict
    assert "verify=False" in verdict[1]
    assert out["unverified"] == "ok"  # the explicit opt-out still reads it
    check_checkpoint(good)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _resume_from(root):
    """What a recipe does on --resume, with the warnings it logged."""
    records = _Records()
    logging.getLogger("fsdpfn").addHandler(records)
    try:
        chosen = latest_intact_checkpoint(root)
        state, extra = load_checkpoint(_state(seed=5), chosen)
        try:
            latest_intact_checkpoint(root, fallback=False)
            strict = "ok"
        except CheckpointError as exc:
            strict = str(exc)
    finally:
        logging.getLogger("fsdpfn").removeHandler(records)
    return str(chosen), extra, state.step, strict, records.messages


def _resume_none_intact(root):
    try:
        latest_intact_checkpoint(root)
    except CheckpointError as exc:
        return str(exc)
    return "ok"


@pytest.mark.timeout(510)
def test_resume_falls_back_to_the_newest_intact_checkpoint(spmd1, tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    spmd1.run(_save_two, args=(str(ckpts),), timeout=150)
    newest, older = ckpts / "step_000004", ckpts / "step_000002"
    assert ff.latest_checkpoint(ckpts) == newest  # complete: the plain pick would take it
    key = _negate_q_proj_pair(newest, "__0_0.distcp")
    chosen, extra, step, strict, warnings = spmd1.run(_resume_from, args=(str(ckpts),),
                                                      timeout=150)[0]
    assert chosen == str(older) and extra == {"step": 2} and step == 2
    assert any(str(newest) in w and "__0_0.distcp" in w and key in w for w in warnings), warnings
    assert f"{newest / '__0_0.distcp'}'" in strict and key in strict, strict
    assert "fallback=True" in strict and str(older) in strict, strict
    # a corrupted manifest is skipped the same way
    _flip_bit(older / MANIFEST, '"saved_at"', 2, 0)
    message = spmd1.run(_resume_none_intact, args=(str(ckpts),), timeout=150)[0]
    assert "none intact" in message and "step_000004" in message and "step_000002" in message
    assert "the manifest is corrupted" in message and "start the run over" in message
    assert "--resume" not in message
