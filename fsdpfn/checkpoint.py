"""save_checkpoint, load_checkpoint, export_hf: checkpoints that never lose a run.

A checkpoint is a directory written with torch.distributed.checkpoint (DCP): every rank writes its
own shards, and any mesh shape can load it (dp=2 -> dp=1, dp=1 -> dp=2 x tp=2, ...)::

    <path>/
      .metadata            DCP metadata: every key's global shape, dtype and chunks
      __<r>_<i>.distcp     DCP data: model and optimizer shards, written by rank r
      rng/rank_<r>.pt      rank r's RNG state (torch CPU, CUDA, python random, numpy)
      fsdpfn.json          manifest: step, version, architecture, optimizer status, LR scheduler
                           state, ``extra``, the size of every file above, and ``checksums``:
                           every saved chunk's (sum, position-weighted sum) and a CRC32 of the
                           pickled items, .metadata and the RNG files (fsdpfn.integrity)
      COMPLETE             the marker, written last; a directory without it is not a checkpoint

DCP keys are ``model.<fqn>`` (fqn as in ``state.model.state_dict()``, prefix ``lm.``) and torch's
flattened optimizer state dict under ``optim.``: ``optim.state.<fqn>.<exp_avg|exp_avg_sq|step>``
and ``optim.param_groups.<fqn>.<hyper-parameter>``. Tensors are the fp32 master weights and fp32
Adam moments (``optimizer_dtype``), saved as sharded DTensors.

Atomic publication: every rank writes into ``<path>.tmp-<token>`` next to the target (rank 0 puts
an OWNER file there naming its host and pid); rank 0 then records the file sizes in the manifest,
writes COMPLETE, fsyncs and renames the directory to ``<path>``. An existing checkpoint at ``<path>`` is first renamed aside to ``<path>.old-<token>``
and deleted after the new one is in place. A crash at any point leaves either the previous
checkpoint or the new one complete, and no directory that carries COMPLETE without all of its data;
``load_checkpoint`` of a ``<path>`` whose publication was interrupted between the two renames reads
the complete sibling. Leftovers (``*.old-*``, ``*.tmp-*`` of processes that died) are removed by
the next save into the same directory. Saves to the same path must not overlap (``wait()`` an
asynchronous save before starting the next one to that path). Every rank must see the same file
system (one host, or a shared file system).

Decisions (documented contract):

* ``load_checkpoint`` returns the successor with the saved ``step`` and
  ``version = max(state.version, saved version) + 1`` (weights changed, and versions never go
  back, so a rollout engine never mistakes the loaded weights for ones it holds).
* A trainable state loading a checkpoint without optimizer state (saved from an inference-only
  state), and an inference-only state loading one with optimizer state, raise CheckpointError;
  ``weights_only=True`` loads just the model weights (the state keeps its own optimizer, LR
  scheduler, step and RNG). A trainable state that never stepped has no Adam moments yet; its
  checkpoint records that (optimizer status ``empty``) and loading it leaves the optimizer without
  moments, exactly as saved.
* RNG: at the saved world size, rank r gets rank r's RNG state back; at another world size rank r
  gets saved rank (r mod saved world size)'s.
* ``extra`` must be JSON that round-trips unchanged (dict with str keys; lists, not tuples); rank
  0's is stored and every rank gets it back (``{}`` when none was saved).
* Everything the load reads is checked before anything changes: the marker, the manifest, every
  file's size, every byte of data against the checksums recorded at save (a chunk that differs,
  or that torch's loader cannot read, raises CheckpointError naming the file and the tensor; at
  any world size: each rank sums the parts of saved chunks it reads, on the device, and the
  parts are added over the ranks), the architecture (model_type, sizes, heads, vocabulary, tied
  embeddings, critic), and every key's shape and dtype against the DCP metadata (DCP itself
  would silently cast dtypes and ignore extra keys). The data are read into fresh buffers and
  applied only after every rank read them, so a failure at any stage leaves the state unchanged
  and live, on every rank.
* ``async_save=True`` stages a CPU copy of the state before returning (DCP's stager), then writes
  and publishes in a background thread over a gloo group of its own; the returned AsyncSave's
  ``wait()`` (on every rank) returns once published or raises CheckpointError everywhere.
* ``export_hf`` writes ``config.dtype`` (the compute dtype) by default; ``dtype="float32"`` gives
  the fp32 master weights exactly.
* LoRA states (``config.lora``): the checkpoint holds the adapters alone (``model.`` keys of the
  adapter matrices) and their optimizer state; the frozen base is rebuilt from
  ``config.model_path`` by shard_model. ``export_hf`` writes peft's adapter directory, or with
  ``merged=True`` the HF model with the adapters folded in.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from fsdpfn import integrity, lora
from fsdpfn.errors import CheckpointError
from fsdpfn.agree import agree_on_error, agree_on_error_in_group
from fsdpfn.state import EngineState, advance, check_live, stale_reason

__all__ = ["save_checkpoint", "load_checkpoint", "export_hf", "latest_checkpoint", "AsyncSave",
           "MARKER", "MANIFEST", "FORMAT"]

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
MANIFEST = "fsdpfn.json"
OWNER = "OWNER"
FORMAT = "fsdpfn-checkpoint"
FORMAT_VERSION = 1
ARCH_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
               "tie_word_embeddings")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "spiece.model", "vocab.txt", "chat_template.jinja", "chat_template.json")
_SIDE = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-(?P<token>[0-9a-f]{32})$")
_OPTIM_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_DCP_ERRORS = (Exception, CheckpointException)  # DCP's own exception derives from BaseException


# ---------------------------------------------------------------- small file-system helpers


def _as_path(path, fn: str) -> Path:
    if isinstance(path, Path) or (isinstance(path, (str, os.PathLike)) and os.fspath(path)):
        return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    raise CheckpointError(f"{fn}: path: must be a non-empty str or os.PathLike, got {path!r}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def _side_path(target: Path, kind: str, token: str) -> Path:
    return target.parent / f"{target.name}.{kind}-{token}"


def _read_manifest(path: Path, fn: str = "load_checkpoint") -> dict:
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
                              f"{FORMAT!r}), got format {_get(manifest, 'format')!r}")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{fn}: {str(file)!r}: format_version must be <= "
                              f"{FORMAT_VERSION} (this fsdpfn), got "
                              f"{manifest.get('format_version')!r}; upgrade fsdpfn")
    return manifest


def _get(obj, key):
    return obj.get(key) if isinstance(obj, dict) else None


def _is_fsdpfn_checkpoint(path: Path) -> bool:
    """A directory fsdpfn wrote (complete or not): it carries the marker or the manifest."""
    if _is_complete(path):
        return True
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _saved_at(path: Path) -> float:
    try:
        return float(json.loads((path / MANIFEST).read_text()).get("saved_at", 0.0))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0.0


def _discard(path: Path) -> None:
    """Delete a directory so that no partial state of the deletion looks complete: rename it to
    a ``.old-`` name (atomic), drop the marker, then remove the rest."""
    if not _SIDE.match(path.name):
        aside = _side_path(path, "old", uuid.uuid4().hex)
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


def _cleanup(parent: Path) -> None:
    """Remove leftovers of interrupted saves in ``parent``: every ``*.old-*`` directory, and
    ``*.tmp-*`` directories whose creating process is dead."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _SIDE.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        if match["kind"] == "old" or _owner_dead(entry):
            _discard(entry)


def _rotate(parent: Path, keep_last: int, current: Path) -> list[Path]:
    """Delete fsdpfn checkpoints in ``parent`` beyond the ``keep_last`` most recently saved
    (manifest ``saved_at``); ``current`` is always kept. Returns the deleted paths."""
    found = [e for e in parent.iterdir()
             if e.is_dir() and not _SIDE.match(e.name) and e != current and _is_complete(e)
             and _is_fsdpfn_checkpoint(e)]
    found.sort(key=_saved_at, reverse=True)
    doomed = found[max(keep_last - 1, 0):]
    for path in doomed:
        _discard(path)
    return doomed


def _publish(tmp: Path, target: Path, token: str) -> None:
    """Rename the complete ``tmp`` to ``target``; an existing target is set aside, then deleted."""
    aside = None
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        aside = _side_path(target, "old", token)
        os.rename(target, aside)
    os.rename(tmp, target)  # replaces an empty directory atomically
    _fsync_dir(target.parent)
    if aside is not None:
        _discard(aside)


def _file_sizes(root: Path) -> dict[str, int]:
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
    root = _as_path(root, "latest_checkpoint")
    if not root.is_dir():
        return None
    found = [e for e in root.iterdir() if e.is_dir() and not _SIDE.match(e.name)
             and _is_complete(e) and _is_fsdpfn_checkpoint(e)]
    return max(found, key=_saved_at) if found else None


# ---------------------------------------------------------------- collective helpers


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast(value):
    if _world() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:3])[:600]}"


def _wrap(fn: str, what: str, exc: BaseException) -> CheckpointError:
    """A CheckpointError from any exception, DCP's CheckpointException (a BaseException holding
    each failing rank's exception) included."""
    failures = getattr(exc, "failures", None) if isinstance(exc, CheckpointException) else None
    if isinstance(failures, dict) and failures:
        named = [f[0] for _, f in sorted(failures.items()) if isinstance(f[0], CheckpointError)]
        if named:  # fsdpfn's own verdict from inside DCP (a file named): pass it on as it is
            return CheckpointError(str(named[0]))
        detail = "; ".join(f"rank {rank}: {_one_line(failure[0])}"
                           for rank, failure in sorted(failures.items())[:4])
    else:
        detail = _one_line(exc)
    return CheckpointError(f"{fn}: {what}: failed ({detail})")


# ---------------------------------------------------------------- what a checkpoint describes


def _architecture(state: EngineState) -> dict:
    hf = state.hf_config
    arch = {key: getattr(hf, key, None) for key in ARCH_FIELDS}
    arch["is_critic"] = bool(state.config.is_critic)
    arch["lora"] = state.config.lora is not None
    return arch


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _optimizer_status(state: EngineState) -> str:
    if state.optimizer is None:
        return "none"
    return "saved" if state.optimizer.state else "empty"


def _manifest(state: EngineState, extra: dict, saved_at: float, status: str) -> dict:
    import transformers

    optimizer = {"status": "none"}
    if state.optimizer is not None:
        optimizer = {"status": status, "class": type(state.optimizer).__name__,
                     "param_groups": [_jsonable({k: v for k, v in g.items() if k != "params"})
                                      for g in state.optimizer.param_groups]}
    scheduler = (_jsonable(state.scheduler.state_dict()) if state.scheduler is not None
                 else None)
    mesh = state.mesh
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "step": state.step,
            "version": state.version, "saved_at": saved_at,
            "mesh": {"dp": mesh.dp, "tp": mesh.tp, "cp": mesh.cp, "world_size": _world()},
            "architecture": _architecture(state),
            "dtypes": {"dtype": state.config.dtype,
                       "optimizer_dtype": state.config.optimizer_dtype},
            "optimizer": optimizer, "scheduler": scheduler, "extra": extra,
            "rng": {"world_size": _world()},
            "torch_version": torch.__version__, "transformers_version": transformers.__version__}


def _check_extra(extra, fn: str) -> dict:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise CheckpointError(f"{fn}: extra: must be a JSON-able dict or None, got "
                              f"{type(extra).__name__}")
    try:
        back = json.loads(json.dumps(extra, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{fn}: extra: must be JSON-able (dicts with str keys, lists, str, "
                              f"finite numbers, bool, None), got {exc}") from None
    if back != extra:
        raise CheckpointError(f"{fn}: extra: must come back unchanged from JSON (str keys, "
                              f"lists rather than tuples), got {extra!r}, which reads back as "
                              f"{back!r}")
    return back


# ---------------------------------------------------------------- RNG


def _rng_state(mesh) -> dict:
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos),
                          int(has_gauss), float(cached))
    except ImportError:
        pass
    if mesh.device_type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(mesh.device)
    return state


def _set_rng_state(state: dict, mesh) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and mesh.device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], mesh.device)


def _rng_file(root: Path, rank: int) -> Path:
    return root / "rng" / f"rank_{rank:05d}.pt"


# ---------------------------------------------------------------- save


class AsyncSave:
    """Handle of ``save_checkpoint(..., async_save=True)``.

    The state was copied to CPU memory before save_checkpoint returned, so training may go on
    (the next steps mutate the parameters in place). The write and the publication run in a
    background thread, over a process group of their own. Call ``wait()`` on every rank before
    the next save to the same path and before the job ends: it returns once the checkpoint is
    published, or raises CheckpointError on every rank (nothing is published then).
    """

    def __init__(self, path: Path, group):
        self.path = path
        self._group = group
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self, body) -> None:
        def run():
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - handed to wait()
                self._error = exc if isinstance(exc, CheckpointError) else _wrap(
                    "save_checkpoint", f"asynchronous save to {str(self.path)!r}", exc)

        self._thread = threading.Thread(target=run, name="fsdpfn-async-save", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """True once the background save finished (successfully or not)."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is published; raise CheckpointError if the save failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"save_checkpoint: asynchronous save to {str(self.path)!r} still "
                               f"running after {timeout} s")
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        if self._error is not None:
            raise self._error


def _check_save_args(path, extra, keep_last, async_save) -> tuple[Path, dict]:
    fn = "save_checkpoint"
    target = _as_path(path, fn)
    extra = _check_extra(extra, fn)
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool)
                                  or keep_last < 1):
        raise CheckpointError(f"{fn}: keep_last: must be an integer >= 1 or None, got "
                              f"{keep_last!r}")
    if not isinstance(async_save, bool):
        raise CheckpointError(f"{fn}: async_save: must be a bool, got {async_save!r}")
    if target.exists():
        if not target.is_dir():
            raise CheckpointError(f"{fn}: path {str(target)!r}: must be a new path, an empty "
                                  f"directory or an fsdpfn checkpoint to replace, got a file")
        entries = sorted(p.name for p in target.iterdir())
        if entries and not _is_fsdpfn_checkpoint(target):
            raise CheckpointError(
                f"{fn}: path {str(target)!r}: must be a new path, an empty directory or an fsdpfn "
                f"checkpoint to replace, got a non-empty directory that is not an fsdpfn "
                f"checkpoint ({len(entries)} entries, e.g. {entries[:3]}); refusing to delete it")
    return target, extra


def _model_state(state: EngineState) -> dict:
    """The model part of a checkpoint: every parameter, or the adapters alone for a LoRA state
    (its frozen base is the one of ``config.model_path``)."""
    model_sd = get_model_state_dict(state.model)
    if state.config.lora is not None:
        model_sd = {k: v for k, v in model_sd.items() if lora.is_adapter(k)}
    return model_sd


def _to_save(state: EngineState, status: str) -> dict:
    state_dict = {"model": _model_state(state)}
    if status == "saved":
        state_dict["optim"] = get_optimizer_state_dict(state.model, state.optimizer,
                                                       options=_OPTIM_FLAT)
    return state_dict


def _tidy(parent: Path, keep_last: int | None, current: Path) -> None:
    """Best effort, after publication: leftovers of dead saves, then rotation. A failure here
    loses nothing, so it is logged rather than raised."""
    try:
        _cleanup(parent)
        if keep_last is not None:
            _rotate(parent, keep_last, current)
    except OSError as exc:
        log.warning("save_checkpoint: cleaning up %s failed (%s); the checkpoint %s is published",
                    parent, exc, current)


def _finish(tmp: Path, target: Path, token: str, manifest: dict, keep_last: int | None,
            agree_fn, error: BaseException | None, sums: list | None = None) -> None:
    """Collective: agree that every rank's data is written, then rank 0 records the checksums
    (``sums``: every rank's chunk checksums, None when not taken) and publishes."""
    fn = "save_checkpoint"
    try:
        agree_fn(error)
    except BaseException:
        if _rank() == 0:
            _discard(tmp)
        raise
    error = None
    if _rank() == 0:
        published = False
        try:
            manifest = dict(manifest, files=_file_sizes(tmp))
            if sums is not None:
                small = [rel for rel in manifest["files"] if not rel.endswith(".distcp")]
                manifest["checksums"] = integrity.record(tmp, sums, small)
            _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            (tmp / OWNER).unlink()  # from here on the directory is complete but for its marker
            _fsync_dir(tmp)
            _write_file(tmp / MARKER, f"{FORMAT} step {manifest['step']}\n".encode())
            _fsync_dir(tmp)
            _publish(tmp, target, token)
            published = True
            _tidy(target.parent, keep_last, target)
        except (OSError, CheckpointError) as exc:
            error = _wrap(fn, f"publishing {str(target)!r}", exc)
            if not published:
                _discard(tmp)
    agree_fn(error)


def save_checkpoint(state: EngineState, path, *, extra: dict | None = None,
                    keep_last: int | None = None, async_save: bool = False,
                    checksums: bool = True) -> AsyncSave | None:
    """Save model, optimizer, LR scheduler, step, version, RNG and ``extra`` to ``path`` (DCP,
    sharded, atomic; see the module docstring for the layout). Collective: every rank calls it.

    ``keep_last=N``: after publishing, delete the older fsdpfn checkpoints next to ``path`` (the
    siblings carrying fsdpfn's marker) so that the N most recently saved remain, e.g.
    ``save_checkpoint(state, run_dir / f"step_{state.step}", keep_last=3)``; other directories
    are never touched. ``async_save=True`` copies the state to CPU memory, returns an AsyncSave
    handle at once and writes in the background (publication when done; ``handle.wait()``).
    ``checksums=True`` records a checksum of every saved chunk, taken on the device before the
    copy out, which load_checkpoint verifies (see fsdpfn.integrity); False saves that pass.
    Read-only: the state stays live. Raises CheckpointError (on every rank; nothing published).
    """
    fn = "save_checkpoint"
    error, target, extra_json = None, None, {}
    if stale_reason(state, fn) is None:
        try:
            target, extra_json = _check_save_args(path, extra, keep_last, async_save)
            if not isinstance(checksums, bool):
                raise CheckpointError(f"{fn}: checksums: must be a bool, got {checksums!r}")
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable directory, on one rank
            error = _wrap(fn, f"checking {str(path)!r}", exc)
    check_live(state, fn, local_error=error)
    mesh = state.mesh
    token, saved_at = _broadcast((uuid.uuid4().hex, time.time()))
    tmp = _side_path(target, "tmp", token)
    status = _optimizer_status(state)
    manifest = _manifest(state, extra_json, saved_at, status)

    # stage 1: rank 0 creates the temporary directory; every rank writes its RNG state
    error = None
    try:
        if _rank() == 0:
            tmp.mkdir(parents=True)
            _write_file(tmp / OWNER, json.dumps({"host": socket.gethostname(),
                                                 "pid": os.getpid()}).encode())
    except OSError as exc:
        error = _wrap(fn, f"creating {str(tmp)!r}", exc)
    agree_on_error(mesh, error)
    try:
        rng_file = _rng_file(tmp, _rank())
        rng_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(mesh), rng_file)
    except Exception as exc:  # noqa: BLE001 - OSError, or torch's writer failing (disk full)
        error = _wrap(fn, f"writing {str(tmp / 'rng')!r}", exc)
    try:
        agree_on_error(mesh, error)
    except BaseException:
        if _rank() == 0:
            _discard(tmp)
        raise

    # stage 2: the chunks' checksums, on the device, before DCP copies anything out
    state_dict = _to_save(state, status)
    try:
        sums = _gather_checksums(state_dict, mesh) if checksums else None
    except BaseException:
        if _rank() == 0:
            _discard(tmp)
        raise

    # stage 3: DCP writes the shards (in the background when async); rank 0 then publishes
    if async_save:
        return _save_async(state_dict, tmp, target, token, manifest, keep_last, sums)
    error = None
    try:
        dcp.save(state_dict, checkpoint_id=tmp)
    except _DCP_ERRORS as exc:
        error = _wrap(fn, f"writing {str(tmp)!r}", exc)
    _finish(tmp, target, token, manifest, keep_last, lambda e: agree_on_error(mesh, e), error,
            sums)
    return None


def _gather_checksums(state_dict: dict, mesh) -> list | None:
    """Every rank's chunk checksums (integrity.local_checksums), gathered to rank 0 (a list
    indexed by rank there, None on the other ranks). Collective."""
    error, local = None, []
    try:
        local = integrity.local_checksums(state_dict)
    except CheckpointError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - e.g. a device error, on one rank
        error = _wrap("save_checkpoint", "checksumming the state", exc)
    agree_on_error(mesh, error)
    if _world() == 1:
        return [local]
    gathered = [None] * _world() if _rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    return gathered


def _save_async(state_dict, tmp, target, token, manifest, keep_last, sums) -> AsyncSave:
    # a group of its own: the background thread's collectives never interleave with training's
    group = dist.new_group(backend="gloo") if _world() > 1 else None
    handle = AsyncSave(target, group)
    try:
        future = dcp.async_save(state_dict, checkpoint_id=tmp, process_group=group)
    except _DCP_ERRORS as exc:
        future, staging_error = None, _wrap("save_checkpoint", f"staging {str(tmp)!r}", exc)
    else:
        staging_error = None
    # staging is local: agree before returning so a failure raises on every rank now
    try:
        agree_on_error_in_group(group, staging_error, error_type=CheckpointError)
    except BaseException:
        if _rank() == 0:
            _discard(tmp)
        if group is not None:
            dist.destroy_process_group(group)
        raise

    def body():
        error = None
        try:
            future.result()
        except _DCP_ERRORS as exc:
            error = _wrap("save_checkpoint", f"writing {str(tmp)!r}", exc)
        _finish(tmp, target, token, manifest, keep_last,
                lambda e: agree_on_error_in_group(group, e, error_type=CheckpointError), error,
                sums)

    handle._start(body)  # noqa: SLF001
    return handle


# ---------------------------------------------------------------- load


def _resolve(path: Path) -> Path:
    """The complete checkpoint directory to read for ``path`` (see the module docstring)."""
    fn = "load_checkpoint"
    if path.is_dir():
        if _is_complete(path):
            return path
        raise CheckpointError(
            f"{fn}: path {str(path)!r}: must be a complete fsdpfn checkpoint (a directory "
            f"carrying {MARKER}, written last by save_checkpoint), got a directory without "
            f"{MARKER}: an interrupted save, a partial copy, or not an fsdpfn checkpoint")
    if path.exists():
        raise CheckpointError(f"{fn}: path {str(path)!r}: must be a checkpoint directory, got a "
                              f"file")
    siblings = []
    if path.parent.is_dir():
        for entry in path.parent.iterdir():
            match = _SIDE.match(entry.name)
            if match and match["name"] == path.name and entry.is_dir() and _is_complete(entry):
                siblings.append(entry)
    if not siblings:
        raise CheckpointError(f"{fn}: path {str(path)!r}: must be an existing checkpoint "
                              f"directory, got a path that does not exist")
    chosen = max(siblings, key=_saved_at)
    log.warning("load_checkpoint: %s does not exist; its publication was interrupted, reading "
                "the complete %s instead", path, chosen)
    return chosen


def _check_files(root: Path, manifest: dict) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"load_checkpoint: {str(root / MANIFEST)!r}: files must list "
                              f"every file with its size, including .metadata, got "
                              f"{None if not isinstance(files, dict) else sorted(files)[:5]}")
    for rel, size in files.items():
        file = root / rel
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"load_checkpoint: {str(file)!r}: must exist ({size} bytes "
                                  f"when saved), got no such file: the checkpoint is "
                                  f"incomplete") from None
        if actual != size:
            raise CheckpointError(f"load_checkpoint: {str(file)!r}: must have the {size} bytes "
                                  f"it had when saved, got {actual} bytes: the file is "
                                  f"truncated or corrupted")


def _check_architecture(state: EngineState, manifest: dict, root: Path) -> None:
    saved = manifest.get("architecture") or {}
    here = _architecture(state)
    for key, value in here.items():
        if key in saved and saved[key] != value:
            raise CheckpointError(
                f"load_checkpoint: architecture.{key}: must match the state's, got {saved[key]!r} "
                f"in {str(root)!r} and {value!r} in the state (model "
                f"{here['model_type']!r}); load it into a state built from the same model config")


def _read_metadata(root: Path):
    try:
        return dcp.FileSystemReader(str(root)).read_metadata()
    except _DCP_ERRORS as exc:
        raise _wrap("load_checkpoint", f"reading {str(root / '.metadata')!r}", exc) from None


def _tensor_md(metadata, key: str, root: Path):
    md = metadata.state_dict_metadata.get(key)
    if md is None:
        return None
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"load_checkpoint: key {key!r}: must be a tensor in {str(root)!r}, "
                              f"got {type(md).__name__}")
    return md


def _check_tensor(key: str, md, shape, dtype, root: Path) -> None:
    if tuple(md.size) != tuple(shape):
        raise CheckpointError(f"load_checkpoint: key {key!r}: shape must be {tuple(shape)} (the "
                              f"state's), got {tuple(md.size)} in {str(root)!r}")
    if md.properties.dtype != dtype:
        raise CheckpointError(f"load_checkpoint: key {key!r}: dtype must be {dtype} (the state's; "
                              f"DCP would cast silently), got {md.properties.dtype} in "
                              f"{str(root)!r}")


def _plan_model(state: EngineState, metadata, root: Path) -> dict:
    model_sd = _model_state(state)
    saved = {k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")}
    missing = sorted(set(model_sd) - saved)
    unexpected = sorted(saved - set(model_sd))
    if missing or unexpected:
        raise CheckpointError(f"load_checkpoint: model keys: must match the state's, got "
                              f"{len(missing)} missing (e.g. {missing[:3]}) and {len(unexpected)} "
                              f"unexpected (e.g. {unexpected[:3]}) in {str(root)!r}")
    staged = {}
    for key, value in model_sd.items():
        _check_tensor(f"model.{key}", _tensor_md(metadata, f"model.{key}", root), value.shape,
                      value.dtype, root)
        staged[key] = torch.empty_like(value)  # same DTensor layout; the live tensors stay as-is
    return staged


def _trainable_by_fqn(model) -> dict:
    """Trainable parameters under the names DCP gives their optimizer state."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # the names DCP itself uses

    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            fqns = _get_fqns(model, name)
            out[next(iter(fqns)) if len(fqns) == 1 else name] = param
    return out


def _plan_optim(state: EngineState, metadata, root: Path) -> dict:
    """Buffers for the flattened optimizer state, built from the metadata and checked against
    the parameters, without touching the optimizer (it may have no state yet)."""
    params = _trainable_by_fqn(state.model)
    group_keys = {k for g in state.optimizer.param_groups for k in g if k != "params"}
    live_names = {n for s in state.optimizer.state.values() for n in s}
    staged, names, pg_keys = {}, {}, {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith("optim."):
            continue
        sub = key[len("optim."):]
        section, _, rest = sub.partition(".")
        fqn, _, name = rest.rpartition(".")
        if section not in ("state", "param_groups") or fqn not in params:
            raise CheckpointError(f"load_checkpoint: key {key!r}: must be the optimizer state of "
                                  f"a trainable parameter of the state, got a key the state does "
                                  f"not have in {str(root)!r}")
        if section == "param_groups":
            pg_keys.setdefault(fqn, set()).add(name)
            staged[sub] = ""  # a placeholder DCP replaces with the saved object
            continue
        names.setdefault(fqn, set()).add(name)
        param = params[fqn]
        if isinstance(md, BytesStorageMetadata):
            staged[sub] = ""
        elif len(md.size) == 0:
            staged[sub] = torch.empty((), dtype=md.properties.dtype)
        else:
            _check_tensor(key, md, param.shape, param.dtype, root)
            # where the optimizer keeps its state (host memory for the per-layer step)
            host = getattr(state.optimizer, "empty_state_like", None)
            staged[sub] = host(param) if host else torch.empty_like(param, requires_grad=False)
    for fqn in params:
        if fqn not in names or not group_keys <= pg_keys.get(fqn, set()):
            raise CheckpointError(
                f"load_checkpoint: optimizer state of {fqn!r}: must be in the checkpoint with "
                f"the hyper-parameters {sorted(group_keys)}, got state "
                f"{sorted(names.get(fqn, ()))} and hyper-parameters "
                f"{sorted(pg_keys.get(fqn, ()))} in {str(root)!r}")
        if live_names and names[fqn] != live_names:
            raise CheckpointError(f"load_checkpoint: optimizer state of {fqn!r}: must hold "
                                  f"{sorted(live_names)} like the state's optimizer, got "
                                  f"{sorted(names[fqn])} in {str(root)!r}")
    return staged


class _LoadPlan:
    def __init__(self, root, manifest, staging, load_optim, rng, checksums=None):
        self.root, self.manifest, self.staging = root, manifest, staging
        self.load_optim, self.rng = load_optim, rng
        self.checksums = checksums  # the manifest's record to verify against; None: no check


def _checksums_to_verify(root: Path, manifest: dict, verify) -> dict | None:
    fn = "load_checkpoint"
    if not isinstance(verify, bool):
        raise CheckpointError(f"{fn}: verify: must be a bool, got {verify!r}")
    record = manifest.get("checksums")
    if not verify:
        return None
    if record is None:
        log.warning("load_checkpoint: %s was saved without checksums (checksums=False or an "
                    "older fsdpfn); its data are not verified", root)
        return None
    if not isinstance(record, dict) or record.get("algorithm") != integrity.ALGORITHM:
        raise CheckpointError(f"{fn}: {str(root / MANIFEST)!r}: checksums.algorithm must be "
                              f"{integrity.ALGORITHM!r}, got {_get(record, 'algorithm')!r}; "
                              f"upgrade fsdpfn or pass verify=False")
    return record


def _plan_load(state: EngineState, path, weights_only, verify=True) -> _LoadPlan:
    fn = "load_checkpoint"
    if not isinstance(weights_only, bool):
        raise CheckpointError(f"{fn}: weights_only: must be a bool, got {weights_only!r}")
    root = _resolve(_as_path(path, fn))
    manifest = _read_manifest(root)
    for key in ("step", "version"):
        if not isinstance(manifest.get(key), int) or manifest[key] < 0:
            raise CheckpointError(f"{fn}: {str(root / MANIFEST)!r}: {key} must be an integer >= 0, "
                                  f"got {manifest.get(key)!r}")
    _check_files(root, manifest)
    checksums = _checksums_to_verify(root, manifest, verify)
    integrity.check_file(root, ".metadata", checksums)
    _check_architecture(state, manifest, root)
    status = _get(manifest.get("optimizer"), "status")
    if status not in ("saved", "empty", "none"):
        raise CheckpointError(f"{fn}: {str(root / MANIFEST)!r}: optimizer.status must be one of "
                              f"['saved', 'empty', 'none'], got {status!r}")
    if not weights_only and state.optimizer is None and status != "none":
        raise CheckpointError(
            f"{fn}: optimizer: the checkpoint {str(root)!r} holds optimizer state (saved by a "
            f"trainable state at step {manifest.get('step')}), but this state is inference-only "
            f"(optimizer=None); pass weights_only=True to load only the model weights")
    if not weights_only and state.optimizer is not None and status == "none":
        raise CheckpointError(
            f"{fn}: optimizer: this state is trainable, but the checkpoint {str(root)!r} holds no "
            f"optimizer state (saved by an inference-only state); loading it would silently "
            f"reset the Adam moments. Pass weights_only=True to load only the model weights and "
            f"keep this state's optimizer")
    load_optim = not weights_only and state.optimizer is not None
    if load_optim and manifest["optimizer"].get("class") != type(state.optimizer).__name__:
        raise CheckpointError(f"{fn}: optimizer.class: must be {type(state.optimizer).__name__} "
                              f"(the state's), got {manifest['optimizer'].get('class')!r} in "
                              f"{str(root)!r}")
    metadata = _read_metadata(root)
    staging = {"model": _plan_model(state, metadata, root)}
    if load_optim and status == "saved":
        staging["optim"] = _plan_optim(state, metadata, root)
    rng = None
    if not weights_only:
        saved_world = int(_get(manifest.get("rng"), "world_size") or 1)
        file = _rng_file(root, _rank() % saved_world)
        integrity.check_file(root, file.relative_to(root).as_posix(), checksums)
        try:
            rng = torch.load(file, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a broken checkpoint
            raise _wrap(fn, f"reading {str(file)!r}", exc) from None
    return _LoadPlan(root, manifest, staging, load_optim, rng, checksums)


def _read(plan: _LoadPlan) -> integrity.VerifyingPlanner | None:
    """DCP's load into the staging buffers; with checksums, through a reader that names a file
    it cannot read and a planner that sums every chunk on arrival (returned)."""
    if plan.checksums is None:
        dcp.load(plan.staging, checkpoint_id=str(plan.root))
        return None
    planner = integrity.VerifyingPlanner(plan.root, plan.checksums)
    dcp.load(plan.staging, checkpoint_id=str(plan.root), planner=planner,
             storage_reader=integrity.NamingReader(str(plan.root)))
    return planner


def _verify(planner: integrity.VerifyingPlanner, plan: _LoadPlan, mesh) -> None:
    """Collective: every chunk read matches its recorded checksum, or CheckpointError on every
    rank (nothing applied yet)."""
    fn, local, error = "load_checkpoint", None, None
    try:
        local = integrity.local_shares(planner)
    except Exception as exc:  # noqa: BLE001 - e.g. a device error, on one rank
        error = _wrap(fn, f"verifying {str(plan.root)!r}", exc)
    agree_on_error(mesh, error)
    try:
        error = integrity.verify(local, planner, plan.root)
    except Exception as exc:  # noqa: BLE001 - a failure to verify is never a pass
        error = _wrap(fn, f"verifying {str(plan.root)!r}", exc)
    agree_on_error(mesh, error)


def _restore_param_groups(optimizer, saved: list) -> None:
    for group, hyper in zip(optimizer.param_groups, saved):
        for key, value in hyper.items():
            if key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


def _apply(state: EngineState, plan: _LoadPlan) -> None:
    """Everything is read and checked: copy it into the live model, optimizer and scheduler."""
    set_model_state_dict(state.model, plan.staging["model"], options=StateDictOptions(
        strict=state.config.lora is None))  # a LoRA checkpoint holds the adapters alone
    manifest = plan.manifest
    if plan.load_optim:
        if "optim" in plan.staging:
            set_optimizer_state_dict(state.model, state.optimizer, plan.staging["optim"],
                                     options=_OPTIM_FLAT)
        else:  # saved before the first step: no moments, exactly as saved
            state.optimizer.state.clear()
            _restore_param_groups(state.optimizer, manifest["optimizer"].get("param_groups", []))
        for param in state.model.parameters():
            param.grad = None
        if state.scheduler is not None and manifest.get("scheduler") is not None:
            state.scheduler.load_state_dict(copy.deepcopy(manifest["scheduler"]))
    if plan.rng is not None:
        _set_rng_state(plan.rng, state.mesh)


def load_checkpoint(state: EngineState, path, *, weights_only: bool = False,
                    verify: bool = True) -> tuple[EngineState, dict]:
    """Load a checkpoint saved by save_checkpoint at any mesh shape into ``state``'s mesh.

    Returns ``(successor, extra)``; ``state`` is donated (stale afterwards). The successor has the
    saved step and ``version = max(state.version, saved version) + 1``; model, optimizer (Adam
    moments and hyper-parameters), LR scheduler and RNG are those saved. ``weights_only=True``
    loads the model weights only (the successor keeps this state's optimizer, scheduler, step and
    RNG). ``verify=True`` checks every chunk read against the checksums recorded at save
    (fsdpfn.integrity; at any world size); a checkpoint saved without them loads unverified, with
    a warning. Collective. Raises CheckpointError on every rank, with the state unchanged and live,
    for a missing, incomplete, truncated, corrupted or mismatching checkpoint (the file and the
    tensor named; see the module docstring).
    """
    fn = "load_checkpoint"
    error, plan = None, None
    if stale_reason(state, fn) is None:
        try:
            plan = _plan_load(state, path, weights_only, verify)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - e.g. a malformed manifest, on one rank
            error = _wrap(fn, f"checking {str(path)!r}", exc)
    check_live(state, fn, local_error=error)

    # read into the fresh buffers (summing each chunk as it lands); nothing live changes until
    # every rank has read and verified everything
    error, planner = None, None
    try:
        planner = _read(plan)
    except _DCP_ERRORS as exc:
        error = _wrap(fn, f"reading {str(plan.root)!r}", exc)
    agree_on_error(state.mesh, error)
    if planner is not None:
        _verify(planner, plan, state.mesh)

    error = None
    try:
        _apply(state, plan)
    except Exception as exc:  # noqa: BLE001 - cannot happen after the checks; never silently
        error = _wrap(fn, f"applying {str(plan.root)!r} (the state is now partially loaded; "
                          f"build it again with shard_model)", exc)
    agree_on_error(state.mesh, error)
    manifest = plan.manifest
    step = state.step if weights_only else int(manifest["step"])
    version = max(state.version, int(manifest["version"])) + 1
    successor = advance(state, fn, steps=step - state.step, version=version)
    return successor, copy.deepcopy(manifest.get("extra") or {})


# ---------------------------------------------------------------- HF export


def _export_dtype(dtype, state: EngineState) -> torch.dtype:
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype is None:
        return names[state.config.dtype]
    if isinstance(dtype, torch.dtype) and dtype in names.values():
        return dtype
    if isinstance(dtype, str) and dtype in names:
        return names[dtype]
    raise CheckpointError(f"export_hf: dtype: must be None (config.dtype) or one of "
                          f"{sorted(names)}, got {dtype!r}")


def _shard_bytes(size) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*", size)
        if match:
            unit = {"B": 1, None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10,
                    "MiB": 2**20, "GiB": 2**30}[match[2]]
            value = int(float(match[1]) * unit)
            if value > 0:
                return value
    raise CheckpointError(f"export_hf: max_shard_size: must be a positive number of bytes or a "
                          f"size like '5GB', got {size!r}")


def _check_export_target(target: Path) -> None:
    if not target.exists():
        return
    if not target.is_dir():
        raise CheckpointError(f"export_hf: path {str(target)!r}: must be a new path, an empty "
                              f"directory or an HF model directory to replace, got a file")
    entries = sorted(p.name for p in target.iterdir())
    if entries and "config.json" not in entries and "adapter_config.json" not in entries:
        raise CheckpointError(
            f"export_hf: path {str(target)!r}: must be a new path, an empty directory or an HF "
            f"model or adapter directory (with config.json or adapter_config.json) to replace, "
            f"got a non-empty directory without config.json or adapter_config.json "
            f"({len(entries)} entries, e.g. {entries[:3]}); refusing to delete it")


def _hf_tensors(state: EngineState, full: dict, dtype: torch.dtype) -> dict:
    tensors, seen = {}, set()
    for key, value in full.items():
        name = key[len("lm."):] if key.startswith("lm.") else key
        value = value.to(dtype) if value.is_floating_point() else value
        value = value.contiguous()
        if value.data_ptr() in seen:  # safetensors refuses shared storage
            value = value.clone()
        seen.add(value.data_ptr())
        tensors[name] = value
    if getattr(state.hf_config, "tie_word_embeddings", False) and not state.config.is_critic:
        tensors.pop("lm_head.weight", None)  # tied: HF rebuilds it from embed_tokens
    return tensors


def _write_safetensors(tmp: Path, tensors: dict, max_bytes: int) -> None:
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for name, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def _write_adapter(state: EngineState, tensors: dict, target: Path, dtype: torch.dtype) -> None:
    """peft's adapter directory (adapter_model.safetensors, adapter_config.json naming
    ``config.model_path`` as the base) plus the base's tokenizer files; atomic like _write_hf."""
    source = Path(state.config.model_path).resolve() if state.config.model_path else None
    config = lora.peft_config(state.config.lora, state.model.lm,
                              base_path=None if source is None else str(source))
    _write_atomic(target, lambda tmp: (lora.write_adapter_dir(tmp, tensors, config, dtype),
                                       _copy_tokenizer(source, tmp)))


def _copy_tokenizer(source: Path | None, tmp: Path) -> None:
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)


def _write_atomic(target: Path, fill) -> None:
    """``fill(tmp)`` writes a directory next to ``target``, then it is fsynced and renamed in."""
    token = uuid.uuid4().hex
    tmp = _side_path(target, "tmp", token)
    tmp.mkdir(parents=True)
    try:
        (tmp / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        fill(tmp)
        (tmp / OWNER).unlink()
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        _publish(tmp, target, token)
    except BaseException:
        _discard(tmp)
        raise
    _cleanup(target.parent)


def _write_hf(state: EngineState, full: dict, target: Path, dtype: torch.dtype,
              max_bytes: int) -> None:
    from transformers import GenerationConfig

    token = uuid.uuid4().hex
    tmp = _side_path(target, "tmp", token)
    tmp.mkdir(parents=True)
    try:
        (tmp / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        if state.config.lora is not None:  # adapters folded into their base weights
            full = lora.merge_full_state(full, state.config.lora)
        _write_safetensors(tmp, _hf_tensors(state, full, dtype), max_bytes)
        config = copy.deepcopy(state.hf_config)
        config._attn_implementation = None  # fsdpfn's packed kernel is not an HF option
        config.architectures = [type(state.model.lm).__name__]
        config.dtype = dtype
        config.save_pretrained(tmp)
        source = Path(state.config.model_path) if state.config.model_path else None
        if source is not None and (source / "generation_config.json").is_file():
            shutil.copy2(source / "generation_config.json", tmp / "generation_config.json")
        elif not state.config.is_critic:
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        if source is not None:
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, tmp / name)
        (tmp / OWNER).unlink()
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        _publish(tmp, target, token)
    except BaseException:
        _discard(tmp)
        raise
    _cleanup(target.parent)


def export_hf(state: EngineState, path, *, dtype: str | torch.dtype | None = None,
              max_shard_size: int | str = "5GB", merged: bool = False) -> None:
    """Write a consolidated HF model directory that ``from_pretrained`` loads (collective).

    ``path`` gets config.json (``architectures`` and ``dtype`` set), safetensors weights
    (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` when larger than ``max_shard_size``), generation_config.json
    (copied from ``config.model_path`` when it has one), and the tokenizer files of
    ``config.model_path``. Weights are written in ``dtype`` (default ``config.dtype``, the compute
    dtype; ``"float32"`` writes the master weights exactly). Tied embeddings are written once.
    Critics are written in the HF token-classification layout (``score.weight``, ``num_labels=1``)
    that ``AutoModelForTokenClassification`` loads. The directory is written next to ``path`` and
    renamed into place; an existing HF directory at ``path`` is replaced. Read-only.

    A LoRA state (``config.lora``) writes peft's adapter layout by default
    (``adapter_model.safetensors`` and ``adapter_config.json`` naming ``config.model_path`` as
    the base, which ``peft.PeftModel.from_pretrained`` loads), and with ``merged=True`` the HF
    model above with every adapter folded in (W + alpha/rank · B @ A, computed in float32).
    ``merged`` is a no-op for a state without adapters.
    """
    fn = "export_hf"
    error, target, torch_dt, max_bytes = None, None, None, None
    if stale_reason(state, fn) is None:
        try:
            if not isinstance(merged, bool):
                raise CheckpointError(f"{fn}: merged: must be a bool, got {merged!r}")
            target = _as_path(path, fn)
            torch_dt = _export_dtype(dtype, state)
            max_bytes = _shard_bytes(max_shard_size)
            _check_export_target(target)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable directory, on one rank
            error = _wrap(fn, f"checking {str(path)!r}", exc)
    check_live(state, fn, local_error=error)
    if state.config.lora is not None and not merged:
        _export_adapter(state, target, torch_dt)
        return
    # every rank takes part in the gather; rank 0 ends up with the full CPU tensors
    full = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
    error = None
    if _rank() == 0:
        try:
            _write_hf(state, full, target, torch_dt, max_bytes)
        except Exception as exc:  # noqa: BLE001 - rank 0 alone writes: the others must hear
            error = _wrap(fn, f"writing {str(target)!r}", exc)
    del full
    agree_on_error(state.mesh, error)


def _export_adapter(state: EngineState, target: Path, dtype: torch.dtype) -> None:
    """Collective: the adapters gathered whole; rank 0 writes peft's adapter directory."""
    tensors = lora.gather_adapters(state.model, device=state.mesh.device, keep=_rank() == 0)
    error = None
    if _rank() == 0:
        try:
            _write_adapter(state, tensors, target, dtype)
        except Exception as exc:  # noqa: BLE001 - rank 0 alone writes: the others must hear
            error = _wrap("export_hf", f"writing {str(target)!r}", exc)
    agree_on_error(state.mesh, error)
