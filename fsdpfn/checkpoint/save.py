"""save_checkpoint: the manifest, the RNG states and the sharded save, published atomically.

An asynchronous save (``async_save=True``) writes in the background through
fsdpfn.checkpoint.save_async, which hands the outcome back to this module's publication."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from fsdpfn.checkpoint import integrity
from fsdpfn.engine import lora
from fsdpfn.agree import agree_on_error, given_path, rank, same_on_every_rank, world_size
from fsdpfn.checkpoint.dcp import DCP_ERRORS, OPTIM_FLAT, as_checkpoint_error
from fsdpfn.checkpoint.files import (ARCH_FIELDS, FORMAT, FORMAT_VERSION, MANIFEST, MARKER, OWNER,
                                     as_path, clean_up_leftovers, discard, file_sizes, fsync_dir,
                                     is_fsdpfn_checkpoint, publish_dir, rotate, side_path,
                                     with_seal, write_file)
from fsdpfn.checkpoint.save_async import AsyncSave, save_async, start_save, wait_for_prior
from fsdpfn.errors import CheckpointError
from fsdpfn.engine.state import EngineState, check_live, stale_reason
from fsdpfn.wire.model_fingerprint import config_fields

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- what a checkpoint describes


def architecture_of(state: EngineState) -> dict:
    hf = state.hf_config
    arch = {key: getattr(hf, key, None) for key in ARCH_FIELDS}
    arch["is_critic"] = bool(state.config.is_critic)
    arch["lora"] = state.config.lora is not None
    cfg = state.config.lora
    if cfg is not None:  # what the adapters compute: loading them under other ones is refused
        arch["lora_rank"], arch["lora_alpha"] = cfg.rank, cfg.alpha
        arch["lora_targets"] = sorted(lora.targets_of(state.model.lm))
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
            "mesh": {"dp": mesh.dp, "tp": mesh.tp, "cp": mesh.cp, "world_size": world_size()},
            "architecture": architecture_of(state),
            # what else changes the forward for the same weights (rope_theta, windows, ...)
            "config_fields": config_fields(state.hf_config),
            "dtypes": {"dtype": state.config.dtype,
                       "optimizer_dtype": state.config.optimizer_dtype},
            "optimizer": optimizer, "scheduler": scheduler, "extra": extra,
            "rng": {"world_size": world_size()},
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


def restore_rng_state(state: dict, mesh) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and mesh.device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], mesh.device)


def rng_path(root: Path, rank: int) -> Path:
    return root / "rng" / f"rank_{rank:05d}.pt"


# ---------------------------------------------------------------- save


def _check_save_args(path, extra, keep_last, async_save) -> tuple[Path, dict]:
    fn = "save_checkpoint"
    target = as_path(path, fn)
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
        if entries and not is_fsdpfn_checkpoint(target):
            raise CheckpointError(
                f"{fn}: path {str(target)!r}: must be a new path, an empty directory or an fsdpfn "
                f"checkpoint to replace, got a non-empty directory that is not an fsdpfn "
                f"checkpoint ({len(entries)} entries, e.g. {entries[:3]}); refusing to delete it")
    return target, extra


def model_state_of(state: EngineState) -> dict:
    """The model part of a checkpoint: every parameter, or the adapters alone for a LoRA state
    (its frozen base is the one of ``config.model_path``)."""
    model_sd = get_model_state_dict(state.model)
    if state.config.lora is not None:
        model_sd = {k: v for k, v in model_sd.items() if lora.is_adapter(k)}
    return model_sd


def _to_save(state: EngineState, status: str) -> dict:
    state_dict = {"model": model_state_of(state)}
    if status == "saved":
        state_dict["optim"] = get_optimizer_state_dict(state.model, state.optimizer,
                                                       options=OPTIM_FLAT)
    return state_dict


def copy_bytes(state: EngineState) -> int:
    """Bytes of this rank's shards that a checkpoint of ``state`` holds (its weights, or the
    adapters alone with LoRA, and the optimizer state): what an asynchronous save copies to host
    memory first."""
    def local(value) -> int:
        if isinstance(value, dict):
            return sum(local(v) for v in value.values())
        if isinstance(value, torch.Tensor):
            value = value.to_local() if hasattr(value, "to_local") else value
            return value.numel() * value.element_size()
        return 0

    return local(_to_save(state, _optimizer_status(state)))


def _tidy(parent: Path, keep_last: int | None, current: Path) -> None:
    """Best effort, after publication: leftovers of dead saves, then rotation. A failure here
    loses nothing, so it is logged rather than raised."""
    try:
        clean_up_leftovers(parent)
        if keep_last is not None:
            rotate(parent, keep_last, current)
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
        if rank() == 0:
            discard(tmp)
        raise
    error = None
    if rank() == 0:
        published = False
        try:
            manifest = dict(manifest, files=file_sizes(tmp))
            if sums is not None:
                small = [rel for rel in manifest["files"] if not rel.endswith(".distcp")]
                manifest["checksums"] = integrity.record(tmp, sums, small)
            write_file(tmp / MANIFEST, json.dumps(with_seal(manifest), indent=1).encode())
            write_file(tmp / MARKER, f"{FORMAT} step {manifest['step']}\n".encode())
            fsync_dir(tmp)
            # the owner stays until the directory is published: a save that dies before that
            # leaves a side directory the next save can tell is dead (and, complete, publishes)
            publish_dir(tmp, target, token)
            published = True
            (target / OWNER).unlink(missing_ok=True)
            _tidy(target.parent, keep_last, target)
        except (OSError, CheckpointError) as exc:
            error = as_checkpoint_error(fn, f"publishing {str(target)!r}", exc)
            if not published:
                discard(tmp)
    agree_fn(error)


def save_checkpoint(state: EngineState, path, *, extra: dict | None = None,
                    keep_last: int | None = None, async_save: bool = False,
                    checksums: bool = True,
                    publish_after: AsyncSave | None = None) -> AsyncSave | None:
    """Save model, optimizer, LR scheduler, step, version, RNG and ``extra`` to ``path`` (DCP,
    sharded, atomic; see the module docstring for the layout). Collective: every rank calls it.

    ``keep_last=N``: after publishing, delete the older fsdpfn checkpoints next to ``path`` (the
    siblings carrying fsdpfn's marker) so that the N most recently saved remain, e.g.
    ``save_checkpoint(state, run_dir / f"step_{state.step}", keep_last=3)``; other directories
    are never touched. ``async_save=True`` copies the state to CPU memory, returns an AsyncSave
    handle at once and writes in the background (publication when done; ``handle.wait()``).
    ``checksums=True`` records a checksum of every saved chunk, taken on the device before the
    copy out, which load_checkpoint verifies (see fsdpfn.checkpoint.integrity); False saves that
    pass. ``publish_after``: the AsyncSave of another checkpoint that must be published before
    this one is (a policy's checkpoint implies its critic's): this one publishes only after it,
    and not at all if it failed. Read-only: the state stays live. Raises CheckpointError (on
    every rank; nothing published).
    """
    fn = "save_checkpoint"
    error, target, extra_json = None, None, {}
    if stale_reason(state, fn) is None:
        try:
            target, extra_json = _check_save_args(path, extra, keep_last, async_save)
            if not isinstance(checksums, bool):
                raise CheckpointError(f"{fn}: checksums: must be a bool, got {checksums!r}")
            if publish_after is not None and not isinstance(publish_after, AsyncSave):
                raise CheckpointError(f"{fn}: publish_after: must be an AsyncSave or None, got "
                                      f"{type(publish_after).__name__}")
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable directory, on one rank
            error = as_checkpoint_error(fn, f"checking {str(path)!r}", exc)
    check_live(state, fn, local_error=error)
    # every rank writes its shards under its own path: a path that differs by rank (a timestamp,
    # a rank's own clock) would publish rank 0's part alone as a complete checkpoint
    same_on_every_rank(fn, {"path": given_path(path), "keep_last": keep_last,
                            "async_save": bool(async_save), "checksums": checksums},
                       error_type=CheckpointError)
    mesh = state.mesh
    token, saved_at = start_save((uuid.uuid4().hex, time.time()))
    tmp = side_path(target, "tmp", token)
    status = _optimizer_status(state)
    manifest = _manifest(state, extra_json, saved_at, status)

    # stage 1: rank 0 creates the temporary directory; every rank writes its RNG state
    error = None
    try:
        if rank() == 0:
            tmp.mkdir(parents=True)
            write_file(tmp / OWNER, json.dumps({"host": socket.gethostname(),
                                                "pid": os.getpid()}).encode())
    except OSError as exc:
        error = as_checkpoint_error(fn, f"creating {str(tmp)!r}", exc)
    agree_on_error(mesh, error)
    try:
        rng_file = rng_path(tmp, rank())
        rng_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(mesh), rng_file)
    except Exception as exc:  # noqa: BLE001 - OSError, or torch's writer failing (disk full)
        error = as_checkpoint_error(fn, f"writing {str(tmp / 'rng')!r}", exc)
    try:
        agree_on_error(mesh, error)
    except BaseException:
        if rank() == 0:
            discard(tmp)
        raise

    # stage 2: the chunks' checksums, on the device, before DCP copies anything out
    state_dict = _to_save(state, status)
    try:
        sums = _gather_checksums(state_dict, mesh) if checksums else None
    except BaseException:
        if rank() == 0:
            discard(tmp)
        raise

    # stage 3: DCP writes the shards (in the background when async); rank 0 then publishes
    if async_save:
        return save_async(state_dict, tmp, target, publish_after,
                          lambda agree_fn, error: _finish(tmp, target, token, manifest, keep_last,
                                                          agree_fn, error, sums))
    error = None
    try:
        dcp.save(state_dict, checkpoint_id=tmp)
    except DCP_ERRORS as exc:
        error = as_checkpoint_error(fn, f"writing {str(tmp)!r}", exc)
    error = error or wait_for_prior(publish_after, target)
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
        error = as_checkpoint_error("save_checkpoint", "checksumming the state", exc)
    agree_on_error(mesh, error)
    if world_size() == 1:
        return [local]
    gathered = [None] * world_size() if rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    return gathered


