"""DiskTarget: HF safetensors under ``root/v{version}/``, published atomically, old ones rotated.

Layout of a published version (loadable by ``AutoModelForCausalLM.from_pretrained``)::

    root/v12/config.json
    root/v12/model.safetensors                      # or model-0000i-of-0000n.safetensors, one per
    root/v12/model.safetensors.index.json           #    bucket, with the HF index
    root/v12/fsdpfn_manifest.json                   # version, names, dtypes, shapes, sha256 each

Rank 0 writes each bucket as one safetensors file while the ranks gather the next one, into
``root/.tmp-v12-<id>/``; the manifest is written last and fsynced, then the directory is renamed
to ``v12`` (a version pushed twice replaces the older copy). A directory without a manifest is
never a published version. After publishing, all but the ``keep_last`` most recently published
versions are deleted (by the time each was published, as ``save_checkpoint``'s ``keep_last``
counts; the version just published always stays, a lower one than those on disk included: a
trainer resumed from an older checkpoint pushes its version + 1).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from fsdpfn.errors import ConfigError
from fsdpfn.validators import check_dir
from fsdpfn.agree import agree_on_error, capture_error, is_rank_zero
from fsdpfn.engine.state import EngineState
from fsdpfn.engine.shard import source_config
from fsdpfn.weights.gather import Bucket, plan_buckets, send, weight_params
from fsdpfn.wire.protocol import (DEFAULT_BUCKET_BYTES, MANIFEST, combine_checksums,
                                  dtype_from_name, dtype_name, sha256_of, tensor_checksum,
                                  write_manifest)

__all__ = ["DiskTarget", "write_version", "published_versions"]


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None:
        try:
            dtype_from_name(dtype)
        except ValueError as exc:
            raise ConfigError(f"dtype: {exc}") from None


class DiskTarget:
    """Push into ``root/v{version}/`` (HF safetensors), keeping the ``keep_last`` most recently
    published (this push's among them).

    dtype: the dtype written (None: the state's compute dtype, ``EngineConfig.dtype``).
    bucket_bytes: bytes gathered and written per file (default 1 GiB).
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int = 2, dtype: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        check_dir("root", root)
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
            raise ConfigError(f"keep_last: must be an int >= 1, got {keep_last!r}")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) \
                or bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes: must be an int >= 1, got {bucket_bytes!r}")
        _check_dtype(dtype)
        self.root = Path(root)
        self.keep_last = keep_last
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes

    def __repr__(self) -> str:
        return f"DiskTarget(root={str(self.root)!r}, keep_last={self.keep_last})"

    def push(self, state: EngineState) -> tuple[int, int]:
        """Collective. Returns (n_tensors, n_bytes); raises WeightSyncError on every rank."""
        dtype = dtype_from_name(self.dtype or state.config.dtype)
        final, n_tensors, n_bytes, _ = write_version(state, self.root, dtype=dtype,
                                                     bucket_bytes=self.bucket_bytes)
        error = None
        if is_rank_zero():
            _, error = capture_error(lambda: rotate(self.root, self.keep_last, final),
                                     "rotating old versions")
        agree_on_error(state.mesh, error)
        return n_tensors, n_bytes


class _Writer:
    """Rank 0's side of a disk push (a fsdpfn.weights.gather.Sender): one safetensors file per
    bucket, written by a worker thread (overlapping the gathers); ``conclude`` writes the index
    and the manifest (fsynced, the commit) and renames the directory into place."""

    flat = False
    start_before_finish = False

    def __init__(self, tmp: Path, final: Path, version: int, n_buckets: int, n_bytes: int):
        self.tmp, self.final, self.version = tmp, final, version
        self.n_buckets, self.n_bytes = n_buckets, n_bytes
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fsdpfn-disk")
        self.entries: dict[str, dict] = {}
        self.checksums: dict[str, int] = {}
        self.files: dict[str, str] = {}
        self.checksum = 0  # the weights checksum of what was published

    def file_name(self, index: int) -> str:
        if self.n_buckets == 1:
            return "model.safetensors"
        return f"model-{index + 1:05d}-of-{self.n_buckets:05d}.safetensors"

    def start(self, bucket: Bucket, tensors: list[torch.Tensor]) -> Any:
        return self.pool.submit(self._write, bucket, tensors)

    def _write(self, bucket: Bucket, tensors: list[torch.Tensor]) -> None:
        from safetensors.torch import save_file

        name = self.file_name(bucket.index)
        named = {s.name: t.contiguous() for s, t in zip(bucket.specs, tensors)}
        save_file(named, str(self.tmp / name), metadata={"format": "pt"})
        for spec, t in zip(bucket.specs, tensors):
            self.entries[spec.name] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                                       "file": name, "sha256": sha256_of(t)}
            self.checksums[spec.name] = tensor_checksum(t)
            self.files[spec.name] = name

    def finish(self, future) -> None:
        future.result()

    def conclude(self) -> None:
        _write_index(self.tmp, self, self.n_bytes)
        self.checksum = combine_checksums(self.checksums)
        write_manifest(self.tmp, version=self.version, entries=self.entries,
                       files=sorted(set(self.files.values())), weights_checksum=self.checksum)
        _publish(self.tmp, self.final)

    def abandon(self) -> None:
        return None  # write_version removes the unpublished directory

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _write_config(state: EngineState, directory: Path, dtype: torch.dtype) -> None:
    config = source_config(state.hf_config)  # the model's own dropout fields
    config.architectures = [type(state.model.lm).__name__]
    config.dtype = dtype_name(dtype)
    config.save_pretrained(str(directory))


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (same version pushed again) is
    replaced: moved aside first, deleted after."""
    aside = None
    if final.exists():
        aside = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
    os.rename(tmp, final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def write_version(state: EngineState, root: Path, *, dtype: torch.dtype,
                  bucket_bytes: int) -> tuple[Path, int, int, int]:
    """Collective: gather every bucket, rank 0 writes and publishes ``root/v{version}``.

    Returns (published directory, n_tensors, n_bytes, weights checksum; 0 off rank 0)."""
    params = weight_params(state)
    buckets = plan_buckets(params, dtype, bucket_bytes)
    n_tensors = sum(len(b.specs) for b in buckets)
    n_bytes = sum(s.nbytes for b in buckets for s in b.specs)
    root = Path(root)
    final = root / f"v{state.version}"
    tmp = root / f".tmp-v{state.version}-{uuid.uuid4().hex[:8]}"
    writer, error = None, None
    if is_rank_zero():
        def prepare():
            tmp.mkdir(parents=True)
            _write_config(state, tmp, dtype)
            return _Writer(tmp, final, state.version, len(buckets), n_bytes)
        writer, error = capture_error(prepare, f"creating {str(tmp)!r}")
    agree_on_error(state.mesh, error)
    try:
        send(state, params, buckets, writer, out_device=torch.device("cpu"))
    finally:
        if writer is not None:
            writer.close()
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final, n_tensors, n_bytes, writer.checksum if writer is not None else 0


def _write_index(tmp: Path, writer: _Writer, n_bytes: int) -> None:
    if writer.n_buckets == 1:
        return
    index = {"metadata": {"total_size": n_bytes}, "weight_map": writer.files}
    with open(tmp / "model.safetensors.index.json", "w") as fh:
        json.dump(index, fh, indent=1)


def published_versions(root: Path) -> list[tuple[int, Path]]:
    """(version, directory) of every published ``v*`` under ``root`` (manifest present), oldest
    first."""
    out = []
    for entry in Path(root).glob("v*"):
        tail = entry.name[1:]
        if entry.is_dir() and tail.isdigit() and (entry / MANIFEST).is_file():
            out.append((int(tail), entry))
    return sorted(out)


STALE_S = 3600.0  # a .tmp-/.old- directory untouched this long was left by a crash


def rotate(root: Path, keep_last: int, current: Path) -> None:
    """Delete all but the ``keep_last`` most recently published versions, ``current`` (the one
    just published) always among them, and what crashed writes left (``.tmp-*`` and ``.old-*``
    directories untouched for STALE_S)."""
    keep_recent(published_versions(root), keep_last, current, MANIFEST)
    now = time.time()
    for entry in [*Path(root).glob(".tmp-v*-*"), *Path(root).glob(".old-v*-*")]:
        try:
            stale = entry.is_dir() and now - entry.stat().st_mtime > STALE_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


def keep_recent(versions: list[tuple[int, Path]], keep_last: int, current: Path,
                marker: str) -> None:
    """Delete all of ``versions`` ((version, directory)) but ``current`` and the ``keep_last``
    - 1 others published most recently: a directory's publication time is its ``marker``
    file's, written last (ties: the higher version)."""
    def published_at(item: tuple[int, Path]) -> tuple[int, int]:
        try:
            return (item[1] / marker).stat().st_mtime_ns, item[0]
        except OSError:
            return 0, item[0]

    current = Path(current).resolve()
    others = [v for v in versions if v[1].resolve() != current]
    others.sort(key=published_at, reverse=True)
    for _, directory in others[keep_last - 1:]:
        shutil.rmtree(directory, ignore_errors=True)

