"""load_checkpoint: check everything a checkpoint holds, read it, then apply it."""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                     set_optimizer_state_dict)

from fsdpfn.checkpoint import integrity
from fsdpfn.agree import agree_on_error, given_path, rank, same_on_every_rank
from fsdpfn.checkpoint.dcp import DCP_ERRORS, OPTIM_FLAT, as_checkpoint_error
from fsdpfn.checkpoint.files import (MANIFEST, MARKER, SIDE_NAME, as_path, field_of, is_complete,
                                     read_manifest, saved_at_of)
from fsdpfn.checkpoint.save import architecture_of, model_state_of, restore_rng_state, rng_path
from fsdpfn.errors import CheckpointError
from fsdpfn.engine.state import EngineState, advance, check_live, stale_reason
from fsdpfn.wire.model_fingerprint import config_fields, diff_config_fields

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- load


def _resolve(path: Path) -> Path:
    """The complete checkpoint directory to read for ``path`` (see the module docstring)."""
    fn = "load_checkpoint"
    if path.is_dir():
        if is_complete(path):
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
            match = SIDE_NAME.match(entry.name)
            if match and match["name"] == path.name and entry.is_dir() and is_complete(entry):
                siblings.append(entry)
    if not siblings:
        raise CheckpointError(f"{fn}: path {str(path)!r}: must be an existing checkpoint "
                              f"directory, got a path that does not exist")
    chosen = max(siblings, key=saved_at_of)
    log.warning("load_checkpoint: %s does not exist; its publication was interrupted, reading "
                "the complete %s instead", path, chosen)
    return chosen


def check_files(root: Path, manifest: dict, fn: str = "load_checkpoint") -> None:
    """Every file the manifest lists is there with its size; CheckpointError from ``fn``."""
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"{fn}: {str(root / MANIFEST)!r}: files must list "
                              f"every file with its size, including .metadata, got "
                              f"{None if not isinstance(files, dict) else sorted(files)[:5]}")
    for rel, size in files.items():
        file = root / rel
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{fn}: {str(file)!r}: must exist ({size} bytes "
                                  f"when saved), got no such file: the checkpoint is "
                                  f"incomplete") from None
        if actual != size:
            raise CheckpointError(f"{fn}: {str(file)!r}: must have the {size} bytes "
                                  f"it had when saved, got {actual} bytes: the file is "
                                  f"truncated or corrupted")


def _check_architecture(state: EngineState, manifest: dict, root: Path) -> None:
    saved = manifest.get("architecture") or {}
    here = architecture_of(state)
    for key, value in here.items():
        if key in saved and saved[key] != value:
            raise CheckpointError(
                f"load_checkpoint: architecture.{key}: must match the state's, got {saved[key]!r} "
                f"in {str(root)!r} and {value!r} in the state (model "
                f"{here['model_type']!r}); load it into a state built from the same model config"
                + (" and EngineConfig.lora" if key.startswith("lora") else ""))


def _warn_config_fields(state: EngineState, manifest: dict, root: Path) -> None:
    """A checkpoint saved under other values of a field that changes the forward for the same
    weights (rope_theta, a window, a softcap: ``fsdpfn.wire.model_fingerprint``) loads, as
    continued training under a longer rotary base does on purpose; a UserWarning names each
    field with both values. A manifest from before the fields were recorded is not compared."""
    saved = manifest.get("config_fields")
    if not isinstance(saved, dict):
        return
    here = config_fields(state.hf_config)
    names = diff_config_fields(saved, here)
    if names and rank() == 0:
        shown = ", ".join(f"{n}: {saved.get(n, '(absent)')!r} saved, {here.get(n, '(absent)')!r} "
                          f"here" for n in names)
        warnings.warn(f"load_checkpoint: {str(root)!r} was saved from a model config that "
                      f"computes differently from the state's ({shown}); its weights are loaded "
                      f"and run under the state's config", UserWarning, stacklevel=3)


def _read_metadata(root: Path):
    try:
        return dcp.FileSystemReader(str(root)).read_metadata()
    except DCP_ERRORS as exc:
        raise as_checkpoint_error("load_checkpoint", f"reading {str(root / '.metadata')!r}",
                                  exc) from None


def _tensor_md(metadata, key: str, root: Path):
    md = metadata.state_dict_metadata.get(key)
    if md is None:
        return None
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"load_checkpoint: key {key!r}: must be a tensor in {str(root)!r}, "
                              f"got {type(md).__name__}")
    return md


def _check_tensor(key: str, md, shape, dtype, root: Path, *, hint: str = "") -> None:
    if tuple(md.size) != tuple(shape):
        raise CheckpointError(f"load_checkpoint: key {key!r}: shape must be {tuple(shape)} (the "
                              f"state's), got {tuple(md.size)} in {str(root)!r}")
    if md.properties.dtype != dtype:
        raise CheckpointError(f"load_checkpoint: key {key!r}: dtype must be {dtype} (the state's; "
                              f"DCP would cast silently), got {md.properties.dtype} in "
                              f"{str(root)!r}{hint}")


def _castable(saved: torch.dtype, here: torch.dtype) -> bool:
    return saved != here and saved.is_floating_point and here.is_floating_point


def _plan_model(state: EngineState, metadata, root: Path, *,
                cast: bool = False) -> tuple[dict, dict]:
    """Buffers for the model's tensors, each checked against the checkpoint's metadata. With
    ``cast`` (weights_only), a floating tensor saved in another dtype (a run of another
    optimizer_dtype) is read in its own dtype, so its checksums hold, and cast to the state's
    on apply (_cast_model); without it, another dtype is refused. Returns the buffers and the
    state's dtype of each key read in another."""
    model_sd = model_state_of(state)
    saved = {k[len("model."):] for k in metadata.state_dict_metadata if k.startswith("model.")}
    missing = sorted(set(model_sd) - saved)
    unexpected = sorted(saved - set(model_sd))
    if missing or unexpected:
        raise CheckpointError(f"load_checkpoint: model keys: must match the state's, got "
                              f"{len(missing)} missing (e.g. {missing[:3]}) and {len(unexpected)} "
                              f"unexpected (e.g. {unexpected[:3]}) in {str(root)!r}")
    staged, casts = {}, {}
    hint = "" if cast else ("; pass weights_only=True to load the weights cast to the state's "
                            "dtype")
    for key, value in model_sd.items():
        md = _tensor_md(metadata, f"model.{key}", root)
        dtype = value.dtype
        if cast and _castable(md.properties.dtype, value.dtype):
            dtype, casts[key] = md.properties.dtype, value.dtype
        _check_tensor(f"model.{key}", md, value.shape, dtype, root, hint=hint)
        # same DTensor layout; the live tensors stay as-is
        staged[key] = torch.empty_like(value, dtype=dtype)
    return staged, casts


def _cast_model(staged: dict, casts: dict) -> dict:
    """The staged model tensors in the state's dtypes (``casts``: those read in another)."""
    return {k: v.to(casts[k]) if k in casts else v for k, v in staged.items()}


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
        if fqn not in names or "lr" not in pg_keys.get(fqn, set()):
            raise CheckpointError(
                f"load_checkpoint: optimizer state of {fqn!r}: must be in the checkpoint with "
                f"its param group's hyper-parameters, got state "
                f"{sorted(names.get(fqn, ()))} and hyper-parameters "
                f"{sorted(pg_keys.get(fqn, ()))} in {str(root)!r}")

        if live_names and names[fqn] != live_names:
            raise CheckpointError(f"load_checkpoint: optimizer state of {fqn!r}: must hold "
                                  f"{sorted(live_names)} like the state's optimizer, got "
                                  f"{sorted(names[fqn])} in {str(root)!r}")
    return staged


class _LoadPlan:
    def __init__(self, root, manifest, staging, load_optim, rng, checksums=None, casts=None):
        self.root, self.manifest, self.staging = root, manifest, staging
        self.casts = casts or {}  # model keys read in the saved dtype, to cast on apply
        self.load_optim, self.rng = load_optim, rng
        self.checksums = checksums  # the manifest's record to verify against; None: no check


def _checksums_to_verify(root: Path, manifest: dict, verify: bool) -> dict | None:
    """The record to verify the data against (the manifest is sealed, so a record that is
    absent was never written: a save with checksums=False)."""
    fn = "load_checkpoint"
    record = manifest.get("checksums")
    if not verify:
        return None
    if record is None:
        log.warning("load_checkpoint: %s was saved with checksums=False; its data are not "
                    "verified", root)
        return None
    if not isinstance(record, dict) or record.get("algorithm") != integrity.ALGORITHM:
        raise CheckpointError(f"{fn}: {str(root / MANIFEST)!r}: checksums.algorithm must be "
                              f"{integrity.ALGORITHM!r}, got {field_of(record, 'algorithm')!r}; "
                              f"upgrade fsdpfn or pass verify=False")
    return record


def _plan_load(state: EngineState, path, weights_only, verify=True) -> _LoadPlan:
    fn = "load_checkpoint"
    if not isinstance(weights_only, bool):
        raise CheckpointError(f"{fn}: weights_only: must be a bool, got {weights_only!r}")
    if not isinstance(verify, bool):
        raise CheckpointError(f"{fn}: verify: must be a bool, got {verify!r}")
    root = _resolve(as_path(path, fn))
    manifest = read_manifest(root, fn, verify)
    if not verify:
        log.warning("load_checkpoint: %s is loaded unverified (verify=False): neither its "
                    "manifest nor its data are checked against the checksums saved", root)
    for key in ("step", "version"):
        if not isinstance(manifest.get(key), int) or manifest[key] < 0:
            raise CheckpointError(f"{fn}: {str(root / MANIFEST)!r}: {key} must be an integer >= 0, "
                                  f"got {manifest.get(key)!r}")
    check_files(root, manifest)
    checksums = _checksums_to_verify(root, manifest, verify)
    integrity.check_file(root, ".metadata", checksums)
    _check_architecture(state, manifest, root)
    _warn_config_fields(state, manifest, root)
    status = field_of(manifest.get("optimizer"), "status")
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
    metadata = _read_metadata(root)
    if load_optim and not _same_moments(state.optimizer, manifest["optimizer"].get("class"),
                                        metadata):
        raise CheckpointError(f"{fn}: optimizer.class: must be {type(state.optimizer).__name__} "
                              f"(the state's), got {manifest['optimizer'].get('class')!r} in "
                              f"{str(root)!r} (EngineConfig.optimizer_dtype differs between the "
                              f"run that saved it and this state, and with it the master "
                              f"weights' dtype: build the state with the saved run's "
                              f"optimizer_dtype, or pass weights_only=True to load the weights "
                              f"alone, cast to this state's dtype; "
                              f"engine.fsdp.per_layer_optim_step may differ)")
    model, casts = _plan_model(state, metadata, root, cast=weights_only)
    staging = {"model": model}
    if load_optim and status == "saved":
        staging["optim"] = _plan_optim(state, metadata, root)
    rng = None
    if not weights_only:
        saved_world = int(field_of(manifest.get("rng"), "world_size") or 1)
        file = rng_path(root, rank() % saved_world)
        integrity.check_file(root, file.relative_to(root).as_posix(), checksums)
        try:
            rng = torch.load(file, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a broken checkpoint
            raise as_checkpoint_error(fn, f"reading {str(file)!r}", exc) from None
    return _LoadPlan(root, manifest, staging, load_optim, rng, checksums, casts)


def _same_moments(optimizer, saved_class, metadata) -> bool:
    """Whether a checkpoint's optimizer state loads into ``optimizer``: the same class, or the
    same moments kept elsewhere. AdamW and the per-layer step's PerLayerAdamW hold exp_avg and
    exp_avg_sq; KahanAdamW and PerLayerAdamW over bf16 master weights add compensation. So
    engine.fsdp.per_layer_optim_step may change across a resume; optimizer_dtype may not."""
    here = type(optimizer).__name__
    if saved_class == here:
        return True
    families = {"AdamW": False, "KahanAdamW": True}
    if saved_class == "PerLayerAdamW":  # which moments: the checkpoint's keys say
        saved = any(k.endswith(".compensation") for k in metadata.state_dict_metadata)
    elif saved_class in families:
        saved = families[saved_class]
    else:
        return False
    mine = bool(getattr(optimizer, "kahan", False)) if here == "PerLayerAdamW" \
        else families.get(here)
    return mine is not None and mine == saved


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
        error = as_checkpoint_error(fn, f"verifying {str(plan.root)!r}", exc)
    agree_on_error(mesh, error)
    try:
        error = integrity.verify(local, planner, plan.root)
    except Exception as exc:  # noqa: BLE001 - a failure to verify is never a pass
        error = as_checkpoint_error(fn, f"verifying {str(plan.root)!r}", exc)
    agree_on_error(mesh, error)


def _hyper(optimizer) -> list[dict]:
    """Each param group's hyper-parameters (everything but its parameters)."""
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _with_own_hyper(state: EngineState, staged: dict) -> dict:
    """The flattened optimizer state with the param-group keys the checkpoint lacks (another
    optimizer class saved it: the per-layer step has none of torch AdamW's amsgrad,
    capturable, ...) set to the state's own; _apply keeps the state's values for every key."""
    out = dict(staged)
    params = _trainable_by_fqn(state.model)
    group_of = {id(p): g for g in state.optimizer.param_groups for p in g["params"]}
    for fqn, param in params.items():
        group = group_of.get(id(param))
        for key, value in (group or {}).items():
            if key != "params":
                out.setdefault(f"param_groups.{fqn}.{key}", copy.deepcopy(value))
    return out


def _schedule_at(state: EngineState, saved: dict) -> None:
    """The scheduler at the saved position (its step count), on the state's own schedule and
    peak rates: the rates of the state's OptimizerConfig at that step."""
    sched = state.scheduler
    sched.last_epoch = int(saved["last_epoch"])
    if "_step_count" in saved:
        sched._step_count = int(saved["_step_count"])  # noqa: SLF001 - torch's own counter
    rates = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, rate in zip(state.optimizer.param_groups, rates):
        group["lr"] = rate
    sched._last_lr = rates  # noqa: SLF001 - what get_last_lr() reports


def _apply(state: EngineState, plan: _LoadPlan) -> None:
    """Everything is read and checked: copy it into the live model, optimizer and scheduler.
    The optimizer's moments and step counts and the schedule's position are the checkpoint's;
    its hyper-parameters (lr, betas, eps, weight decay, the schedule) stay the state's own,
    those of its OptimizerConfig, so a state built with another config continues with it."""
    set_model_state_dict(state.model, _cast_model(plan.staging["model"], plan.casts),
                         options=StateDictOptions(strict=state.config.lora is None))
    # (strict=False for LoRA: a LoRA checkpoint holds the adapters alone)
    manifest = plan.manifest
    if plan.load_optim:
        own = _hyper(state.optimizer)
        if "optim" in plan.staging:
            set_optimizer_state_dict(state.model, state.optimizer,
                                     _with_own_hyper(state, plan.staging["optim"]),
                                     options=OPTIM_FLAT)
        else:  # saved before the first step: no moments
            state.optimizer.state.clear()
        for group, hyper in zip(state.optimizer.param_groups, own):
            group.update(hyper)
        for param in state.model.parameters():
            param.grad = None
        if state.scheduler is not None and manifest.get("scheduler") is not None:
            _schedule_at(state, manifest["scheduler"])
    if plan.rng is not None:
        restore_rng_state(plan.rng, state.mesh)


def load_checkpoint(state: EngineState, path, *, weights_only: bool = False,
                    verify: bool = True) -> tuple[EngineState, dict]:
    """Load a checkpoint saved by save_checkpoint at any mesh shape into ``state``'s mesh.

    Returns ``(successor, extra)``; ``state`` is donated (stale afterwards). The successor has the
    saved step and ``version = max(state.version, saved version) + 1``; the model, the
    optimizer's moments and step counts, the LR schedule's position and the RNG are those saved,
    while the optimizer's hyper-parameters (lr, betas, eps, weight decay, schedule) are the
    state's own OptimizerConfig (a state built with a changed config continues with it).
    ``weights_only=True`` loads the model weights only (the successor keeps this state's
    optimizer, scheduler, step and RNG), cast to the state's dtype where they were saved in
    another (a run of another optimizer_dtype; the checksums are verified before the cast).
    ``verify=True`` first checks the manifest's own CRC32 (a manifest without it, from an older
    fsdpfn, is refused), then every chunk read against the
    checksums recorded at save (fsdpfn.checkpoint.integrity; at any world size); a checkpoint
    saved with checksums=False loads with a logged warning; ``verify=False`` reads everything
    unverified. Collective. Raises CheckpointError
    on every rank, with the state unchanged and live, for a missing, incomplete, truncated,
    corrupted or mismatching checkpoint (the file and the tensor named; see the module
    docstring).
    """
    fn = "load_checkpoint"
    error, plan = None, None
    # a path or option that differs by rank would load a mix of checkpoints, or wait forever
    same_on_every_rank(fn, {"path": given_path(path), "weights_only": weights_only,
                            "verify": verify}, error_type=CheckpointError)
    if stale_reason(state, fn) is None:
        try:
            plan = _plan_load(state, path, weights_only, verify)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - e.g. a malformed manifest, on one rank
            error = as_checkpoint_error(fn, f"checking {str(path)!r}", exc)
    check_live(state, fn, local_error=error)

    # read into the fresh buffers (summing each chunk as it lands); nothing live changes until
    # every rank has read and verified everything
    error, planner = None, None
    try:
        planner = _read(plan)
    except DCP_ERRORS as exc:
        error = as_checkpoint_error(fn, f"reading {str(plan.root)!r}", exc)
    agree_on_error(state.mesh, error)
    if planner is not None:
        _verify(planner, plan, state.mesh)

    error = None
    try:
        _apply(state, plan)
    except Exception as exc:  # noqa: BLE001 - cannot happen after the checks; never silently
        error = as_checkpoint_error(fn, f"applying {str(plan.root)!r} (the state is now "
                                    f"partially loaded; build it again with shard_model)", exc)
    agree_on_error(state.mesh, error)
    manifest = plan.manifest
    step = state.step if weights_only else int(manifest["step"])
    version = max(state.version, int(manifest["version"])) + 1
    successor = advance(state, fn, steps=step - state.step, version=version)
    return successor, copy.deepcopy(manifest.get("extra") or {})
