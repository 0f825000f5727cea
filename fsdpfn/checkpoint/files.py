"""Checkpoint layout, file-system helpers and atomic publication (see fsdpfn.checkpoint).

The names of a checkpoint's files, the side directories ``<path>.tmp-<token>`` and
``<path>.old-<token>`` a save writes into and renames, their cleanup and rotation, and
``latest_checkpoint``. The standard library only: ``fsdpfn run``'s launcher names a run's
checkpoint without importing torch (the DCP and collective helpers are fsdpfn.checkpoint.dcp).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
import zlib
from pathlib import Path

from fsdpfn.errors import CheckpointError

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
MANIFEST = "fsdpfn.json"
OWNER = "OWNER"
FORMAT = "fsdpfn-checkpoint"
FORMAT_VERSION = 2  # 2: the manifest carries its own CRC32 (SEAL) and the checksums of
# fsdpfn.wire.checksum; 1: no seal, the sums modulo 2**32 (refused unless verify=False)
SEAL = "manifest_crc32"
ARCH_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
               "tie_word_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "spiece.model", "vocab.txt", "chat_template.jinja", "chat_template.json")
SIDE_NAME = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-(?P<token>[0-9a-f]{32})$")


# ---------------------------------------------------------------- small file-system helpers


def as_path(path, fn: str) -> Path:
    if isinstance(path, Path) or (isinstance(path, (str, os.PathLike)) and os.fspath(path)):
        return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    raise CheckpointError(f"{fn}: path: must be a non-empty str or os.PathLike, got {path!r}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def side_path(target: Path, kind: str, token: str) -> Path:
    return target.parent / f"{target.name}.{kind}-{token}"


def _canonical(manifest: dict) -> bytes:
    """The manifest without its seal as canonical JSON (sorted keys, no spaces, ASCII): the bytes
    its CRC32 covers, whatever the file's own layout."""
    body = {k: v for k, v in manifest.items() if k != SEAL}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def with_seal(manifest: dict) -> dict:
    """The manifest with its seal: the CRC32 of its canonical JSON."""
    return dict(manifest, **{SEAL: zlib.crc32(_canonical(manifest))})


def _check_seal(file: Path, manifest: dict, fn: str) -> None:
    """A manifest is trusted only when its seal matches (any flipped bit of a step, of extra, of
    a key name such as ``checksums``, or of the seal itself, is refused)."""
    if SEAL not in manifest:
        raise CheckpointError(
            f"{fn}: {str(file)!r}: must carry {SEAL} (the manifest's own CRC32, written by fsdpfn "
            f"with format_version {FORMAT_VERSION}), got none (format_version "
            f"{manifest.get('format_version')!r}): an older fsdpfn's checkpoint or a corrupted "
            f"manifest; pass verify=False to load_checkpoint to read it unverified")
    actual = zlib.crc32(_canonical(manifest))
    if manifest[SEAL] != actual:
        raise CheckpointError(f"{fn}: {str(file)!r}: its CRC32 must be {manifest[SEAL]!r} as "
                              f"recorded in {SEAL}, got {actual}: the manifest is corrupted")


def read_manifest(path: Path, fn: str = "load_checkpoint", verify: bool = True) -> dict:
    """The manifest of the checkpoint at ``path``, its seal checked unless ``verify=False``."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{fn}: {str(file)!r}: must exist in an fsdpfn checkpoint, got no "
                              f"such file") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{fn}: {str(file)!r}: must be a readable JSON manifest, got "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{fn}: {str(file)!r}: must be an fsdpfn manifest (format "
                              f"{FORMAT!r}), got format {field_of(manifest, 'format')!r}")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{fn}: {str(file)!r}: format_version must be <= "
                              f"{FORMAT_VERSION} (this fsdpfn), got "
                              f"{manifest.get('format_version')!r}; upgrade fsdpfn")
    if verify:
        _check_seal(file, manifest, fn)
    return manifest


def field_of(obj, key):
    return obj.get(key) if isinstance(obj, dict) else None


def is_fsdpfn_checkpoint(path: Path) -> bool:
    """A directory fsdpfn wrote (complete or not): its manifest names fsdpfn's format, or its
    marker is fsdpfn's ("fsdpfn-checkpoint step N"). A file that is merely named COMPLETE (a
    tool's own results beside the checkpoints) is not: such a directory is never rotated,
    resumed from or overwritten."""
    try:
        if (path / MARKER).read_bytes().startswith(FORMAT.encode()):
            return True
    except OSError:
        pass
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def saved_at_of(path: Path) -> float:
    try:
        return float(json.loads((path / MANIFEST).read_text()).get("saved_at", 0.0))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0.0


def discard(path: Path) -> None:
    """Delete a directory so that no partial state of the deletion looks complete: rename it to
    a ``.old-`` name (atomic), drop the marker, then remove the rest."""
    if not SIDE_NAME.match(path.name):
        aside = side_path(path, "old", uuid.uuid4().hex)
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        path = aside
    try:
        (path / MARKER).unlink()
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _owner_dead(path: Path) -> bool:
    """True when the process that created this temporary directory is gone (same host)."""
    try:
        owner = json.loads((path / OWNER).read_text())
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        # no readable owner: a save killed before writing it, or not ours; old enough is stale
        try:
            return time.time() - path.stat().st_mtime > 3600
        except OSError:
            return False
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def clean_up_leftovers(parent: Path) -> None:
    """Finish or remove what interrupted saves left in ``parent``. A publication cut short
    (the target missing) is finished: a complete ``*.tmp-*`` of a dead save is renamed to its
    target, else the ``*.old-*`` copy that publication set aside (the same token; a deletion's
    ``*.old-*`` has none) goes back. Then every ``*.old-*`` directory and the ``*.tmp-*``
    directories whose creating process is dead are removed."""
    try:
        entries = sorted(parent.iterdir(), key=lambda e: e.name)
    except OSError:
        return
    sides = [(e, m) for e in entries if e.is_dir() for m in [SIDE_NAME.match(e.name)] if m]
    # a save still running (its tmp's owner alive) may be between its two renames: its target
    # is its own to publish
    running = {m["name"] for e, m in sides if m["kind"] == "tmp" and not _owner_dead(e)}
    publishing = {(m["name"], m["token"]) for _, m in sides if m["kind"] == "tmp"}
    # the new copy first: a complete tmp of a dead save, then the old copy it was to replace
    for entry, match in sorted(sides, key=lambda s: s[1]["kind"] != "tmp"):
        target = parent / match["name"]
        if not entry.exists() or target.exists() or match["name"] in running \
                or not is_complete(entry) or not is_fsdpfn_checkpoint(entry):
            continue
        if match["kind"] == "old":  # set aside by a publication (its tmp shares the token)
            finish = (match["name"], match["token"]) in publishing
        else:
            finish = _owner_dead(entry)
        if finish:
            try:
                os.rename(entry, target)
                (target / OWNER).unlink(missing_ok=True)
                fsync_dir(parent)
                log.warning("checkpoint %s: a save interrupted while publishing it is "
                            "finished (from %s)", target, entry.name)
            except OSError:
                pass
    for entry, match in sides:
        if entry.exists() and (match["kind"] == "old" or _owner_dead(entry)):
            discard(entry)


def rotate(parent: Path, keep_last: int, current: Path) -> list[Path]:
    """Delete fsdpfn checkpoints in ``parent`` beyond the ``keep_last`` most recently saved
    (manifest ``saved_at``); ``current`` is always kept, and never one saved after it (two
    saves that publish out of order keep keep_last + 1 rather than lose the newer). Returns
    the deleted paths."""
    found = [e for e in parent.iterdir()
             if e.is_dir() and not SIDE_NAME.match(e.name) and is_complete(e)
             and is_fsdpfn_checkpoint(e)]
    if current not in found:
        found.append(current)
    found.sort(key=saved_at_of, reverse=True)
    doomed = [e for e in found[max(keep_last, 1):] if e != current
              and saved_at_of(e) <= saved_at_of(current)]
    for path in doomed:
        discard(path)
    return doomed


def publish_dir(tmp: Path, target: Path, token: str) -> None:
    """Rename the complete ``tmp`` to ``target``; an existing target is set aside, then deleted."""
    aside = None
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        aside = side_path(target, "old", token)
        os.rename(target, aside)
    os.rename(tmp, target)  # replaces an empty directory atomically
    fsync_dir(target.parent)
    if aside is not None:
        discard(aside)


def file_sizes(root: Path) -> dict[str, int]:
    sizes = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel not in (MANIFEST, MARKER, OWNER):
                sizes[rel] = full.stat().st_size
    return dict(sorted(sizes.items()))


def latest_checkpoint(root) -> Path | None:
    """The most recently saved complete fsdpfn checkpoint directly under ``root`` (None if none).

    Use it to resume: ``ckpt = latest_checkpoint(run_dir); if ckpt: state, extra =
    load_checkpoint(state, ckpt)``.
    """
    root = as_path(root, "latest_checkpoint")
    if not root.is_dir():
        return None
    found = [e for e in root.iterdir() if e.is_dir() and not SIDE_NAME.match(e.name)
             and is_complete(e) and is_fsdpfn_checkpoint(e)]
    return max(found, key=saved_at_of) if found else None
