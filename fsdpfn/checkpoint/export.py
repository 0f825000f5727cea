"""export_hf: the model (or its LoRA adapters) as a Hugging Face directory, published atomically."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdpfn.engine import lora
from fsdpfn.agree import agree_on_error, is_rank_zero
from fsdpfn.checkpoint.dcp import as_checkpoint_error
from fsdpfn.checkpoint.files import (OWNER, TOKENIZER_FILES, as_path, clean_up_leftovers, discard,
                                     fsync_dir, publish_dir, side_path)
from fsdpfn.errors import CheckpointError
from fsdpfn.engine.state import EngineState, check_live, stale_reason
from fsdpfn.engine.shard import source_config

log = logging.getLogger("fsdpfn")


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
    return _checkpoint_names(state.model.lm, tensors)


def _checkpoint_names(lm, tensors: dict) -> dict:
    """``tensors`` under the names ``save_pretrained`` writes: where transformers renames a
    family's checkpoint names on load (GPT-NeoX's ``embed_out`` is the module ``lm_head``), the
    export writes the checkpoint's names, as save_pretrained does, so that other loaders
    (vLLM, SGLang, older transformers) read it too. Unchanged where transformers has no such
    mapping for the model, or none at all."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without conversion mappings: names are the model's
        return tensors
    try:  # transformers' internals, whose behaviour moves between releases
        return dict(revert_weight_conversion(lm, tensors))
    except Exception as exc:  # noqa: BLE001 - the model's names: transformers 5 loads them
        log.warning("export_hf: transformers' reverse name mapping failed (%s: %s); writing "
                    "the model's own parameter names", type(exc).__name__, exc)
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
    tmp = side_path(target, "tmp", token)
    tmp.mkdir(parents=True)
    try:
        (tmp / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        fill(tmp)
        (tmp / OWNER).unlink()
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        publish_dir(tmp, target, token)
    except BaseException:
        discard(tmp)
        raise
    clean_up_leftovers(target.parent)


def _write_hf(state: EngineState, full: dict, target: Path, dtype: torch.dtype,
              max_bytes: int) -> None:
    from transformers import GenerationConfig

    def fill(tmp: Path) -> None:
        tensors = full
        if state.config.lora is not None:  # adapters folded into their base weights
            tensors = lora.merge_full_state(full, state.config.lora)
        _write_safetensors(tmp, _hf_tensors(state, tensors, dtype), max_bytes)
        config = source_config(state.hf_config)  # the model's own dropout fields
        config._attn_implementation = None  # fsdpfn's packed kernel is not an HF option
        config.architectures = [type(state.model.lm).__name__]
        config.dtype = dtype
        config.save_pretrained(tmp)
        source = Path(state.config.model_path) if state.config.model_path else None
        if source is not None and (source / "generation_config.json").is_file():
            shutil.copy2(source / "generation_config.json", tmp / "generation_config.json")
        elif not state.config.is_critic:
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        _copy_tokenizer(source, tmp)

    _write_atomic(target, fill)


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
    ``merged`` is a no-op for a state without adapters. An adapter is written as one file, as peft
    writes it: ``max_shard_size`` applies to the full weights.
    """
    fn = "export_hf"
    error, target, torch_dt, max_bytes = None, None, None, None
    if stale_reason(state, fn) is None:
        try:
            if not isinstance(merged, bool):
                raise CheckpointError(f"{fn}: merged: must be a bool, got {merged!r}")
            target = as_path(path, fn)
            torch_dt = _export_dtype(dtype, state)
            max_bytes = _shard_bytes(max_shard_size)
            _check_export_target(target)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable directory, on one rank
            error = as_checkpoint_error(fn, f"checking {str(path)!r}", exc)
    check_live(state, fn, local_error=error)
    if state.config.lora is not None and not merged:
        _export_adapter(state, target, torch_dt)
        return
    # every rank takes part in the gather; rank 0 ends up with the full CPU tensors
    full = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
    error = None
    if is_rank_zero():
        try:
            _write_hf(state, full, target, torch_dt, max_bytes)
        except Exception as exc:  # noqa: BLE001 - rank 0 alone writes: the others must hear
            error = as_checkpoint_error(fn, f"writing {str(target)!r}", exc)
    del full
    agree_on_error(state.mesh, error)


def _export_adapter(state: EngineState, target: Path, dtype: torch.dtype) -> None:
    """Collective: the adapters gathered whole; rank 0 writes peft's adapter directory."""
    tensors = lora.gather_adapters(state.model, device=state.mesh.device, keep=is_rank_zero())
    error = None
    if is_rank_zero():
        try:
            _write_adapter(state, tensors, target, dtype)
        except Exception as exc:  # noqa: BLE001 - rank 0 alone writes: the others must hear
            error = as_checkpoint_error("export_hf", f"writing {str(target)!r}", exc)
    agree_on_error(state.mesh, error)
