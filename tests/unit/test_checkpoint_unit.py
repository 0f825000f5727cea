"""The file-system rules of fsdpfn.checkpoint, in one process (no process group needed).

Publication by rename, the crash windows of a replace, rotation, clean-up of dead saves, and the
argument checks. The multi-rank behaviour is in tests/dist/test_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fsdpfn import checkpoint as C
from fsdpfn.errors import CheckpointError


def _fake_checkpoint(path, *, saved_at, complete=True, payload="x"):
    """A directory shaped like a published checkpoint (manifest, data, marker)."""
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_text(payload)
    (path / ".metadata").write_text("m")
    manifest = {"format": C.FORMAT, "format_version": C.FORMAT_VERSION, "saved_at": saved_at,
                "step": 0, "version": 0}
    (path / C.MANIFEST).write_text(json.dumps(manifest))
    if complete:
        (path / C.MARKER).write_text("done")
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_publish_replaces_an_existing_checkpoint(tmp_path):
    target = _fake_checkpoint(tmp_path / "step_1", saved_at=1.0, payload="old")
    token = uuid.uuid4().hex
    tmp = _fake_checkpoint(C.side_path(target, "tmp", token), saved_at=2.0, payload="new")
    C.publish_dir(tmp, target, token)
    assert (target / "__0_0.distcp").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_publish_into_an_empty_directory(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    token = uuid.uuid4().hex
    tmp = _fake_checkpoint(C.side_path(target, "tmp", token), saved_at=2.0)
    C.publish_dir(tmp, target, token)
    assert C.is_complete(target)


def test_resolve_reads_the_complete_sibling_of_an_interrupted_replace(tmp_path):
    target = tmp_path / "step_2"
    # the crash window of a replace: old set aside, new complete but not yet renamed in
    old = _fake_checkpoint(C.side_path(target, "old", uuid.uuid4().hex), saved_at=1.0)
    new = _fake_checkpoint(C.side_path(target, "tmp", uuid.uuid4().hex), saved_at=2.0)
    assert C._resolve(target) == new
    C.discard(new)
    assert C._resolve(target) == old
    C.discard(old)
    with pytest.raises(CheckpointError, match="does not exist"):
        C._resolve(target)


def test_resolve_never_reads_an_incomplete_directory(tmp_path):
    partial = _fake_checkpoint(tmp_path / "step_3", saved_at=1.0, complete=False)
    with pytest.raises(CheckpointError, match="without COMPLETE"):
        C._resolve(partial)
    # an incomplete sibling is no fallback either
    _fake_checkpoint(C.side_path(tmp_path / "step_4", "tmp", uuid.uuid4().hex), saved_at=1.0,
                     complete=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        C._resolve(tmp_path / "step_4")


def test_check_files_catches_truncation_and_missing_files(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "c", saved_at=1.0)
    manifest = {"files": C.file_sizes(ckpt)}
    assert set(manifest["files"]) == {"__0_0.distcp", ".metadata"}
    C.check_files(ckpt, manifest)
    (ckpt / "__0_0.distcp").write_text("")
    with pytest.raises(CheckpointError, match="must have the 1 bytes.*got 0 bytes"):
        C.check_files(ckpt, manifest)
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata'.*no such file"):
        C.check_files(ckpt, manifest)


def test_rotate_keeps_the_most_recently_saved_and_ignores_other_directories(tmp_path):
    for step, saved_at in ((1, 10.0), (2, 20.0), (3, 30.0), (10, 5.0)):
        _fake_checkpoint(tmp_path / f"step_{step}", saved_at=saved_at)
    (tmp_path / "user_data").mkdir()
    _fake_checkpoint(tmp_path / "half_deleted", saved_at=1.0, complete=False)
    current = _fake_checkpoint(tmp_path / "step_4", saved_at=40.0)
    deleted = C.rotate(tmp_path, 2, current)
    assert sorted(p.name for p in deleted) == ["step_1", "step_10", "step_2"]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["half_deleted", "step_3", "step_4", "user_data"]
    assert C.latest_checkpoint(tmp_path).name == "step_4"


def test_cleanup_removes_leftovers_of_dead_saves_only(tmp_path):
    target = tmp_path / "step_5"
    dead = C.side_path(target, "tmp", uuid.uuid4().hex)
    dead.mkdir()
    (dead / C.OWNER).write_text(json.dumps({"host": socket.gethostname(),
                                            "pid": _dead_pid()}))
    alive = C.side_path(target, "tmp", uuid.uuid4().hex)
    alive.mkdir()
    (alive / C.OWNER).write_text(json.dumps({"host": socket.gethostname(),
                                             "pid": os.getpid()}))
    elsewhere = C.side_path(target, "tmp", uuid.uuid4().hex)
    elsewhere.mkdir()
    (elsewhere / C.OWNER).write_text(json.dumps({"host": "another-host", "pid": 1}))
    ownerless_old = C.side_path(target, "tmp", uuid.uuid4().hex)
    ownerless_old.mkdir()
    os.utime(ownerless_old, (time.time() - 7200, time.time() - 7200))
    aside = _fake_checkpoint(C.side_path(target, "old", uuid.uuid4().hex), saved_at=1.0)
    C.clean_up_leftovers(tmp_path)
    remaining = set(tmp_path.iterdir())
    assert remaining == {alive, elsewhere}
    assert not aside.exists()


def _owned(path, pid):
    (path / C.OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    return path


@pytest.mark.parametrize("new_complete", [True, False], ids=["new-complete", "new-cut"])
def test_cleanup_finishes_a_publication_cut_between_its_renames(tmp_path, new_complete):
    """A save died between setting the old copy aside and renaming its own into place: the
    target is missing. The next save's cleanup publishes the complete new copy (it once
    deleted the old copy at once and the new one an hour later, losing both), else puts the
    old copy back."""
    target, token = tmp_path / "step_2", uuid.uuid4().hex  # one token: one publication
    aside = _fake_checkpoint(C.side_path(target, "old", token), saved_at=1.0, payload="old")
    tmp = _owned(_fake_checkpoint(C.side_path(target, "tmp", token), saved_at=2.0,
                                  complete=new_complete, payload="new"), _dead_pid())
    C.clean_up_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]
    assert (target / "__0_0.distcp").read_text() == ("new" if new_complete else "old")
    assert not (target / C.OWNER).exists() and not aside.exists() and not tmp.exists()
    assert C.latest_checkpoint(tmp_path) == target


def test_cleanup_never_brings_back_a_deletion_cut_short(tmp_path):
    """A rotation's deletion renames the checkpoint aside (a token of its own), then removes
    it: that ``.old-`` copy is finished off, not put back."""
    _fake_checkpoint(C.side_path(tmp_path / "step_1", "old", uuid.uuid4().hex), saved_at=1.0)
    C.clean_up_leftovers(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cleanup_leaves_a_running_save_its_own_publication(tmp_path):
    target = tmp_path / "step_2"
    _fake_checkpoint(C.side_path(target, "old", uuid.uuid4().hex), saved_at=1.0)
    running = _owned(_fake_checkpoint(C.side_path(target, "tmp", uuid.uuid4().hex),
                                      saved_at=2.0), os.getpid())
    C.clean_up_leftovers(tmp_path)
    assert not target.exists() and running.exists()  # the save renames it itself


def test_rotation_never_deletes_a_checkpoint_saved_after_the_one_it_publishes(tmp_path):
    """Two saves that publish out of order (the older last) keep keep_last + 1: the newer
    state is never the one lost (it once was, with keep_last=1)."""
    newer = _fake_checkpoint(tmp_path / "step_2", saved_at=20.0)
    older = _fake_checkpoint(tmp_path / "step_1", saved_at=10.0)
    _fake_checkpoint(tmp_path / "step_0", saved_at=5.0)
    assert [p.name for p in C.rotate(tmp_path, 1, older)] == ["step_0"]
    assert newer.exists() and older.exists() and C.latest_checkpoint(tmp_path) == newer


def test_a_directory_merely_holding_a_file_named_complete_is_not_a_checkpoint(tmp_path):
    """A tool's results beside the checkpoints, with a COMPLETE file of its own, are never
    rotated away, resumed from or overwritten."""
    results = tmp_path / "eval_results"
    results.mkdir()
    (results / "COMPLETE").write_text("done\n")
    (results / "scores.csv").write_text("a,b\n")
    os.utime(results / "COMPLETE", (time.time() + 60, time.time() + 60))
    for step, saved_at in ((1, 10.0), (2, 20.0), (3, 30.0)):
        current = _fake_checkpoint(tmp_path / f"step_{step}", saved_at=saved_at)
        C.rotate(tmp_path, 1, current)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_results", "step_3"]
    assert (results / "scores.csv").exists() and not C.is_fsdpfn_checkpoint(results)
    assert C.latest_checkpoint(tmp_path).name == "step_3"


def test_discard_drops_the_marker_before_the_data(tmp_path, monkeypatch):
    """A deletion cut short after the rename leaves a side directory without its marker (never
    a complete-looking checkpoint), then a finished one leaves nothing."""
    import shutil

    from fsdpfn.checkpoint import files

    ckpt = _fake_checkpoint(tmp_path / "step_1", saved_at=1.0)
    seen = []

    rmtree = shutil.rmtree

    def interrupted(path, *args, **kwargs):  # the process dies before the data is removed
        if Path(path).parent != tmp_path:
            return rmtree(path, *args, **kwargs)
        seen.append((Path(path).name, sorted(p.name for p in Path(path).iterdir())))
        raise KeyboardInterrupt

    monkeypatch.setattr(files.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        C.discard(ckpt)
    (name, left), = seen
    assert not ckpt.exists() and ".old-" in name  # renamed aside first
    assert C.MARKER not in left and left  # the marker went first; the data is still there
    monkeypatch.setattr(files.shutil, "rmtree", rmtree)
    C.discard(tmp_path / name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra, needle", [
    ({"pos": (1, 2)}, "lists rather than tuples"),
    ({1: "a"}, "lists rather than tuples"),
    ({"x": float("nan")}, "JSON-able"),
    ({"x": object()}, "JSON-able"),
    ([1, 2], "dict or None"),
])
def test_extra_must_round_trip_through_json(extra, needle):
    with pytest.raises(CheckpointError, match=needle):
        C._check_extra(extra, "save_checkpoint")


def test_extra_round_trips():
    extra = {"pos": [1, 2], "name": "run", "nested": {"a": None, "b": 1.5, "c": True}}
    assert C._check_extra(extra, "save_checkpoint") == extra
    assert C._check_extra(None, "save_checkpoint") == {}


@pytest.mark.parametrize("size, expected", [(1000, 1000), ("5GB", 5 * 10**9), ("2MiB", 2**21),
                                            ("1.5KB", 1500)])
def test_shard_sizes(size, expected):
    assert C._shard_bytes(size) == expected


@pytest.mark.parametrize("size", [0, -1, "big", True, "0GB"])
def test_bad_shard_sizes(size):
    with pytest.raises(CheckpointError, match="max_shard_size"):
        C._shard_bytes(size)


def test_save_refuses_to_replace_what_it_did_not_write(tmp_path):
    user = tmp_path / "results"
    user.mkdir()
    (user / "metrics.csv").write_text("1,2")
    with pytest.raises(CheckpointError, match="refusing to delete"):
        C._check_save_args(user, None, None, False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="got a file"):
        C._check_save_args(tmp_path / "file", None, None, False)
    ckpt = _fake_checkpoint(tmp_path / "old_ckpt", saved_at=1.0)
    assert C._check_save_args(ckpt, {"a": 1}, 3, True) == (ckpt, {"a": 1})
    with pytest.raises(CheckpointError, match="keep_last"):
        C._check_save_args(tmp_path / "new", None, 0, False)
    with pytest.raises(CheckpointError, match="path: must be a non-empty"):
        C._check_save_args("", None, None, False)


def test_export_target_rules(tmp_path):
    C._check_export_target(tmp_path / "new")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    C._check_export_target(hf)
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_text("x")
    with pytest.raises(CheckpointError, match="without config.json"):
        C._check_export_target(other)


# ---------------------------------------------------------------- chunk checksums (integrity)

from hypothesis import given, settings, strategies as st  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fsdpfn.checkpoint import integrity as I  # noqa: E402
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8,
           torch.bool]
_P, _ROOT = 2**61 - 1, 0x1F0E5C2B3A49D68A


def _reference(t: torch.Tensor) -> int:
    """sum_j u_j * ROOT**j modulo 2**61 - 1 in Python integers, u_j the little-endian signed
    16-bit halfwords of the elements' bytes in row-major order (bytes for 1-byte dtypes)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    units = list(raw) if t.element_size() == 1 else [int(v) for v in
                                                      np.frombuffer(raw, dtype="<i2")]
    return sum(u * pow(_ROOT, j, _P) for j, u in enumerate(units)) % _P


def _tensor(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-2**62 if dtype == torch.int64 else 0, 2**62 if dtype == torch.int64
                             else 255, shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)


_shapes = st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), shape=_shapes, dtype=st.sampled_from(_DTYPES))
def test_chunk_checksum_equals_the_python_integer_reference(seed, shape, dtype):
    t = _tensor(seed, shape, dtype)
    assert int(I.box_hash(t, t.shape)) == _reference(t)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), shape=_shapes.filter(len), dtype=st.sampled_from(_DTYPES),
       data=st.data())
def test_shares_of_sub_boxes_add_up_to_the_chunk_checksum(seed, shape, dtype, data):
    """A load at another world size reads parts of a saved chunk: the parts' shares, computed on
    strided views, must add up to the whole chunk's checksum."""
    t = _tensor(seed, shape, dtype)
    cuts = [sorted({0, n, *data.draw(st.lists(st.integers(1, n), max_size=2))}) for n in shape]
    total = 0
    boxes = [[]]
    for dim_cuts in cuts:
        boxes = [b + [(lo, hi)] for b in boxes for lo, hi in zip(dim_cuts, dim_cuts[1:])]
    for box in boxes:
        view = t[tuple(slice(lo, hi) for lo, hi in box)]
        total += int(I.box_hash(view, t.shape, [lo for lo, _ in box]))
    assert total % _P == _reference(t)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(2, 64), data=st.data())
def test_a_flipped_bit_or_swapped_neighbours_change_the_checksum(seed, n, data):
    t = _tensor(seed, (n,), torch.float32)
    i = data.draw(st.integers(0, n - 2))
    flipped = t.clone()
    flipped.view(torch.int32)[i] ^= 1 << data.draw(st.integers(0, 31))
    assert int(I.box_hash(flipped, t.shape)) != int(I.box_hash(t, t.shape))
    swapped = t.clone()
    swapped[i], swapped[i + 1] = t[i + 1], t[i]
    if not torch.equal(t[i].view(torch.int32), t[i + 1].view(torch.int32)):
        assert int(I.box_hash(swapped, t.shape)) != int(I.box_hash(t, t.shape))
    negated = t.clone()
    negated.view(torch.int32)[[0, n - 1 if n % 2 else n - 2]] ^= -2**31  # sign bits, i + j even
    if n > 2:
        assert int(I.box_hash(negated, t.shape)) != int(I.box_hash(t, t.shape))


def test_checksum_of_a_transposed_view_follows_its_logical_order():
    t = _tensor(3, (5, 8), torch.bfloat16)
    assert int(I.box_hash(t.t(), (8, 5))) == _reference(t.t().contiguous())
    assert int(I.box_hash(t.t(), (8, 5))) != int(I.box_hash(t, (5, 8)))


def test_complex_tensors_are_refused_with_the_dtype_named():
    with pytest.raises(CheckpointError, match="complex128"):
        I.box_hash(torch.zeros(2, dtype=torch.complex128), (2,))


def test_check_file_names_a_corrupted_small_file(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"abcdef")
    import zlib

    record = {"files": {".metadata": zlib.crc32(b"abcdef")}}  # the CRC32 of what was written
    I.check_file(tmp_path, ".metadata", record)
    (tmp_path / ".metadata").write_bytes(b"abcdeF")
    with pytest.raises(CheckpointError, match=r"\.metadata.*CRC32 must be"):
        I.check_file(tmp_path, ".metadata", record)
    I.check_file(tmp_path, ".metadata", None)  # nothing recorded: nothing checked
