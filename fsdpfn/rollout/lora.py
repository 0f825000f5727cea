"""LoRA adapters on the built-in rollout server: SGLang's /load_lora_adapter and
/unload_lora_adapter, served by merging.

Payloads are SGLang's (``LoadLoRAAdapterReqInput``: {lora_name, lora_path, pinned, lora_id};
``UnloadLoRAAdapterReqInput``: {lora_name, lora_id}) and so is the answer (``LoRAUpdateOutput``:
{success, error_message, loaded_adapters: {name: path}}), plus ours: an optional
``weight_version`` in the request (the version served once the adapter is in; default: one
more) and ``weight_version`` / ``weights_checksum`` in the answer.

``lora_path`` is a peft adapter directory (adapter_config.json, adapter_model.safetensors, as
fsdpfn's export_hf and AdapterTarget write). The server serves one adapter at a time, merged:
each target weight becomes base + (alpha / r) · B @ A, computed in float32 and swapped in under
the model lock like a weight update (so generation sees one version from start to end). The base
tensors are kept aside while an adapter is in: loading another adapter (or the same name again,
a new version of it) merges into the base, never into the previous merge; unloading points the
parameters back at the base. A full weight update replaces the base (the adapter is dropped).
Unlike SGLang, loading a name that is already loaded replaces it (SGLang refuses; AdapterTarget
unloads first when a server refuses).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["load_adapter", "unload_adapter", "answer", "read_adapter", "merged_tensors"]

_PREFIX = "base_model.model."


class _Slot:
    """What the engine holds while an adapter is in: its name, path and the base tensors of
    the parameters it changed."""

    def __init__(self, name: str, path: str, base: dict[str, torch.Tensor]):
        self.name, self.path, self.base = name, path, base


def _error(message: str, status: int = 400):
    from fsdpfn.rollout.errors import UpdateError

    return UpdateError(message, status)


def read_adapter(path: Path, device) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a peft adapter directory."""
    from safetensors.torch import load_file

    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise _error(f"lora_path: must be a peft adapter directory (adapter_config.json and "
                     f"adapter_model.safetensors), got {str(path)!r}", 404)
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise _error(f"lora_path: adapter_config.json: peft_type must be 'LORA' without DoRA, "
                     f"got {config.get('peft_type')!r} (use_dora={config.get('use_dora')})")
    return config, load_file(str(weights), device=str(device))


def _scale(config: dict) -> float:
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise _error(f"lora_path: adapter_config.json: r must be an int >= 1 and lora_alpha a "
                     f"number, got r={r!r}, lora_alpha={alpha!r}")
    return alpha / (r ** 0.5 if config.get("use_rslora") else r)


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (A [r, in], B [out, r]) from peft's file keys."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        head, _, kind = key.removesuffix(".weight").rpartition(".")
        if not key.startswith(_PREFIX) or kind not in ("lora_A", "lora_B"):
            raise _error(f"lora_path: tensor {key!r}: must be a peft LoRA matrix "
                         f"('base_model.model.<module>.lora_A.weight' or lora_B), got that key")
        modules.setdefault(head.removeprefix(_PREFIX), {})[kind] = value
    out = {}
    for module, pair in modules.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise _error(f"lora_path: module {module!r}: must have both lora_A and lora_B, got "
                         f"{sorted(pair)}")
        out[module] = (pair["lora_A"], pair["lora_B"])
    return out


def merged_tensors(params: dict[str, torch.Tensor], base: dict[str, torch.Tensor],
                   pairs: dict, scale: float) -> dict[str, torch.Tensor]:
    """For each adapted module, ``<module>.weight`` = base + scale · B @ A in its served dtype
    (base: the kept base tensor when there is one, else the served one)."""
    out = {}
    for module, (a, b) in pairs.items():
        name = f"{module}.weight"
        p = params.get(name)
        if p is None:
            raise _error(f"lora_path: module {module!r}: must be a linear of the served model "
                         f"(no parameter {name!r})")
        w = base.get(name, p.data)
        if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
            raise _error(f"lora_path: module {module!r}: B @ A must have the weight's shape "
                         f"{list(w.shape)}, got B {list(b.shape)} and A {list(a.shape)}")
        delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
        merged = torch.add(w.float(), delta, alpha=scale)  # never in place: w is the base
        if not bool(torch.isfinite(merged).all()):
            raise _error(f"lora_path: module {module!r}: the merged weight must be finite, got "
                         f"NaN/inf")
        out[name] = merged.to(w.dtype)
    return out


def answer(engine, slot, message: str) -> dict:
    """SGLang's LoRAUpdateOutput, plus the served version and weights checksum."""
    return {"success": True, "error_message": None, "message": message,
            "loaded_adapters": {} if slot is None else {slot.name: slot.path},
            "weight_version": engine.version, "weights_checksum": engine.weights_checksum()}


def _version(engine, payload: dict) -> int:
    version = payload.get("weight_version")
    if version is None:
        return engine.version + 1
    if isinstance(version, bool) or not isinstance(version, int):
        raise _error(f"weight_version: must be an int or absent, got {version!r}")
    return version


def load_adapter(engine, slot, payload: dict) -> tuple[dict, _Slot, int]:
    """/load_lora_adapter on ``engine`` (a RolloutEngine) with ``slot`` the adapter in now (or
    None): (tensors to swap in, the new slot, the version they make). The merge is into the
    base (the kept base tensors of ``slot`` where it changed them), never into a previous
    merge; parameters the old adapter changed and the new one does not get their base back.
    Nothing is changed here: a failure leaves weights, version and adapter as they were."""
    name, path = payload.get("lora_name"), payload.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise _error(f"lora_name, lora_path: must be non-empty strings, got {name!r}, {path!r}")
    version = _version(engine, payload)
    config, tensors = read_adapter(Path(path), engine.device)
    base = dict(slot.base) if slot is not None else {}
    merged = merged_tensors(engine.params, base, _pairs(tensors), _scale(config))
    restore = {n: t for n, t in base.items() if n not in merged}
    for n in merged:
        base.setdefault(n, engine.params[n].data)
    return {**restore, **merged}, _Slot(name, path, {n: base[n] for n in merged}), version


def unload_adapter(engine, slot, payload: dict) -> tuple[dict, int]:
    """/unload_lora_adapter: (the base tensors to swap back in, the version they make); 404
    when ``lora_name`` is not the adapter in."""
    name = payload.get("lora_name")
    if slot is None or slot.name != name:
        raise _error(f"lora_name: must name the loaded adapter "
                     f"({None if slot is None else slot.name!r}), got {name!r}", 404)
    return dict(slot.base), _version(engine, payload)
