"""check_checkpoint and latest_intact_checkpoint: which checkpoint a run can resume from.

``check_checkpoint(path)`` checks a saved checkpoint from its files alone, without a state: the
marker, the manifest's own CRC32, every file's size, the CRC32 of .metadata, the RNG files and
every pickled item, and the content checksum of every tensor chunk (each chunk deserialised on
the CPU as DCP's reader does, then hashed). It raises the same CheckpointError a load would,
naming the file and the tensor.

``latest_intact_checkpoint(root)`` is what resuming uses: the newest complete checkpoint under
``root`` that passes that check. A corrupted newer one is skipped with a warning that names it
and why, so a run never stays blocked behind a bad checkpoint while an older intact one exists
(and the steps after it run again). ``fallback=False`` refuses instead, and the error names the
call that would fall back.
"""

from __future__ import annotations

import io
import logging
import zlib
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from fsdpfn.checkpoint import integrity
from fsdpfn.checkpoint.dcp import from_rank_zero
from fsdpfn.checkpoint.files import (MANIFEST, MARKER, SIDE_NAME, as_path, field_of, is_complete,
                                     is_fsdpfn_checkpoint, read_manifest, saved_at_of)
from fsdpfn.agree import rank
from fsdpfn.errors import CheckpointError

log = logging.getLogger(__name__)

__all__ = ["check_checkpoint", "latest_intact_checkpoint"]

_FN = "check_checkpoint"


def check_checkpoint(path) -> None:
    """Check every byte of the checkpoint at ``path`` against what its save recorded (module
    doc); one process, no state needed. Returns None, or raises CheckpointError naming the file
    (and the tensor or item). A checkpoint saved with checksums=False is checked as far as it
    can be (marker, manifest, sizes)."""
    root = as_path(path, _FN)
    if not root.is_dir() or not is_complete(root):
        raise CheckpointError(f"{_FN}: path {str(root)!r}: must be a complete fsdpfn checkpoint "
                              f"(a directory carrying {MARKER}), got "
                              f"{'a directory without it' if root.is_dir() else 'no directory'}")
    try:
        _check_bytes(root)
    except OSError as exc:  # a file the manifest lists is missing or unreadable
        raise CheckpointError(f"{_FN}: {str(exc.filename or root)!r}: every file the checkpoint "
                              f"records must be readable, got {type(exc).__name__}: "
                              f"{exc.strerror or exc}") from None


def _check_bytes(root: Path) -> None:
    from fsdpfn.checkpoint.load import check_files

    manifest = read_manifest(root, _FN)
    check_files(root, manifest, "check_checkpoint")
    record = manifest.get("checksums")
    if record is None:
        return
    if not isinstance(record, dict) or record.get("algorithm") != integrity.ALGORITHM:
        raise CheckpointError(f"{_FN}: {str(root / MANIFEST)!r}: checksums.algorithm must be "
                              f"{integrity.ALGORITHM!r}, got {field_of(record, 'algorithm')!r}")
    for rel in record.get("files", {}):
        integrity.check_file(root, rel, record, _FN)
    metadata = FileSystemReader(str(root)).read_metadata()
    per_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((info.offset, info.length, index))
    for rel, items in sorted(per_file.items()):
        with open(root / rel, "rb") as f:
            for offset, length, index in sorted(items, key=lambda x: x[:2]):
                f.seek(offset)
                _check_item(root / rel, f.read(length), index, metadata, record)


def _check_item(file: Path, data: bytes, index, metadata, record: dict) -> None:
    """One stored item against the record: a pickled item's CRC32, or a chunk's checksum."""
    key = index.fqn
    md = metadata.state_dict_metadata[key]
    if isinstance(md, BytesStorageMetadata):
        expected, actual = record.get("bytes", {}).get(key), zlib.crc32(data)
        if expected != actual:
            raise CheckpointError(f"{_FN}: {str(file)!r}: the item {key!r} must have the CRC32 "
                                  f"{expected} recorded at save, got {actual}: the file is "
                                  f"corrupted")
        return
    offsets = [int(o) for o in index.offset]
    where = f"the chunk of tensor {key!r} at offsets {offsets}"
    try:
        chunk = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch's loader: any error is a bad file
        raise CheckpointError(f"{_FN}: {str(file)!r}: {where} must be readable as saved, got "
                              f"{type(exc).__name__}: the file is truncated or "
                              f"corrupted") from None
    sizes = next((c.sizes for c in md.chunks if [int(o) for o in c.offsets] == offsets), None)
    expected = next((v for o, v in record.get("chunks", {}).get(key, []) if o == offsets), None)
    if sizes is None or tuple(chunk.shape) != tuple(sizes) or expected is None:
        raise CheckpointError(f"{_FN}: {str(file)!r}: {where} must have the shape and the "
                              f"checksum recorded at save, got shape {tuple(chunk.shape)} "
                              f"(saved {None if sizes is None else tuple(sizes)}) and checksum "
                              f"{'recorded' if expected is not None else 'none'}")
    actual = int(integrity.box_hash(chunk, sizes))
    if actual != expected:
        raise CheckpointError(f"{_FN}: {str(file)!r}: {where} must have the checksum "
                              f"{expected} recorded at save, got {actual}: the file is corrupted")


def _candidates(root: Path) -> list[Path]:
    """The complete fsdpfn checkpoints directly under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [e for e in root.iterdir() if e.is_dir() and not SIDE_NAME.match(e.name)
             and is_complete(e) and is_fsdpfn_checkpoint(e)]
    return sorted(found, key=saved_at_of, reverse=True)


def _verdict(path: Path) -> str | None:
    """Rank 0 checks ``path``; every rank gets its verdict (None: intact). Collective when a
    process group is initialised."""
    error = None
    if rank() == 0:
        try:
            check_checkpoint(path)
        except CheckpointError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint is not intact
            error = f"{_FN}: {str(path)!r}: {type(exc).__name__}: {exc}"
    return from_rank_zero(error)


def latest_intact_checkpoint(root, *, fallback: bool = True) -> Path | None:
    """The newest complete checkpoint under ``root`` that check_checkpoint passes, or None when
    ``root`` holds no complete checkpoint. Newer ones that fail are skipped, each logged as a
    warning with the reason. ``fallback=False``: the newest must pass, or CheckpointError (its
    message names the call that falls back). Every candidate failing is a CheckpointError listing
    them. Collective when a process group is initialised (rank 0 reads the files)."""
    fn = "latest_intact_checkpoint"
    if not isinstance(fallback, bool):
        raise CheckpointError(f"{fn}: fallback: must be a bool, got {fallback!r}")
    root = as_path(root, fn)
    candidates = _candidates(root)
    skipped = []
    for i, path in enumerate(candidates):
        error = _verdict(path)
        if error is None:
            return path
        if not fallback:
            after = (f"it would skip this one and check {str(candidates[i + 1])!r} next"
                     if i + 1 < len(candidates) else "but no older complete checkpoint is there")
            raise CheckpointError(f"{error}; latest_intact_checkpoint({str(root)!r}) with "
                                  f"fallback=True resumes from the newest intact checkpoint "
                                  f"instead: {after}")
        log.warning("%s: skipping %s, the newest checkpoint not yet checked, to resume from an "
                    "older one: %s", fn, path, error)
        skipped.append(f"{path.name}: {error}")
    if skipped:
        raise CheckpointError(f"{fn}: {str(root)!r}: must hold an intact checkpoint to resume "
                              f"from, got {len(skipped)} complete ones, none intact ("
                              f"{'; '.join(skipped)}); restore one, or start the run over")
    return None
