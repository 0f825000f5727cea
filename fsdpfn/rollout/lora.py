"""LoRA adapters on the built-in rollout server: SGLang's /load_lora_adapter and
/unload_lora_adapter, served by merging.

Payloads are SGLang's (``LoadLoRAAdapterReqInput``: {lora_name, lora_path, pinned, lora_id};
``UnloadLoRAAdapterReqInput``: {lora_name, lora_id}) and so is the answer (``LoRAUpdateOutput``:
{success, error_message, loaded_adapters: {name: path}}), plus ours: an optional
``weight_version`` in the request (the version served once the adapter is in; default: one
more) and ``weight_version`` / ``weights_checksum`` in the answer.

``lora_path`` is a peft adapter directory (adapter_config.json, adapter_model.safetensors, as
fsdpfn's export_hf and AdapterTarget write). The server serves one adapter at a time, merged:
each target weight becomes base + scale · B @ A, computed in float32 and swapped in under the
model lock like a weight update (so generation sees one version from start to end). The scale is
peft's: alpha / r, or alpha / sqrt(r) with use_rslora, with r and alpha from rank_pattern and
alpha_pattern where a pattern matches the module. Targets must be linear layers of the served
model; peft options that compute something else (DoRA, fan_in_fan_out, biases, modules saved
whole, ...) and adapters whose matrices do not have the config's rank are refused.

The base tensors are kept aside while an adapter is in: loading another adapter (or the same
name again, a new version of it) merges into the base, never into the previous merge; unloading
points the parameters back at the base. A weight update replaces the base: a whole one drops the
adapter, a partial one drops it from the weights it sends. A whole update of a LoRA trainer's
merged weights (``merged_adapters`` in the update) holds adapters already, so the server refuses
to load one on top of it until a whole update of plain weights.

Unlike SGLang: every request is served by the merged weights (SGLang serves the base to requests
that name no adapter, and batches several adapters); loading a name that is already loaded
replaces it (SGLang refuses, and AdapterTarget then unloads and loads again); every refusal is a
400 whose answer still names the adapter served (loaded_adapters).
"""

from __future__ import annotations

import json
import math
import re
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


# peft options that change what an adapter computes beyond base + scale · B @ A: refused by name
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan-in-fan-out (Conv1D) weights",
                "alora_invocation_tokens": "activated LoRA",
                "layer_replication": "layer replication", "use_qalora": "QA-LoRA",
                "lora_bias": "a trained bias", "target_parameters": "LoRA on parameters",
                "modules_to_save": "modules saved whole",
                "trainable_token_indices": "trainable tokens", "megatron_config": "Megatron layers"}


def read_adapter(path: Path, device) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a peft adapter directory; anything that cannot be
    read, or a peft option this server does not compute, is a 400 naming the file and field."""
    from safetensors.torch import load_file

    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    try:
        found = config_file.is_file() and weights.is_file()
    except OSError as exc:  # a name past the file system's length (ENAMETOOLONG)
        raise _error(f"lora_path: must be a peft adapter directory, got {str(path)[:200]!r} "
                     f"({exc.strerror})") from None
    if not found:
        raise _error(f"lora_path: must be a peft adapter directory (adapter_config.json and "
                     f"adapter_model.safetensors), got {str(path)!r}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _error(f"lora_path: {str(config_file)!r} must be a JSON object, got unreadable "
                     f"JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise _error(f"lora_path: {str(config_file)!r} must be a JSON object, got a "
                     f"{type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise _error(f"lora_path: adapter_config.json: peft_type must be 'LORA', got "
                     f"{config.get('peft_type')!r}")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise _error(f"lora_path: adapter_config.json: {key}: must be unset or false "
                         f"({what} is not served here), got {config[key]!r}")
    try:
        tensors = load_file(str(weights), device=str(device))
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types, OSError
        raise _error(f"lora_path: {str(weights)!r} must be a safetensors file, got one that "
                     f"cannot be read ({type(exc).__name__}: {exc})") from None
    return config, tensors


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _pattern(config: dict, key: str, module: str):
    """peft's rank_pattern / alpha_pattern: the value of the first pattern that matches the
    module's path whole or as its tail (peft.utils.other.get_pattern_key), else None."""
    patterns = config.get(key) or {}
    if not isinstance(patterns, dict):
        raise _error(f"lora_path: adapter_config.json: {key}: must be an object of module "
                     f"patterns, got {patterns!r}")
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", module):
                return pattern, value
        except re.error as exc:
            raise _error(f"lora_path: adapter_config.json: {key}: {pattern!r} must be a "
                         f"regular expression ({exc})") from None
    return None


def _rank_and_scale(config: dict, module: str) -> tuple[int, float]:
    """The module's rank and scale: alpha / r (alpha / sqrt(r) with use_rslora), r and alpha
    taken from rank_pattern / alpha_pattern where a pattern matches the module, as peft does."""
    r, alpha = config.get("r"), config.get("lora_alpha")
    r_hit, alpha_hit = _pattern(config, "rank_pattern", module), \
        _pattern(config, "alpha_pattern", module)
    r_field, alpha_field = "r", "lora_alpha"
    if r_hit is not None:
        r_field, r = f"rank_pattern[{r_hit[0]!r}]", r_hit[1]
    if alpha_hit is not None:
        alpha_field, alpha = f"alpha_pattern[{alpha_hit[0]!r}]", alpha_hit[1]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _error(f"lora_path: adapter_config.json: {r_field}: must be an int >= 1, got {r!r}")
    if not _number(alpha):
        raise _error(f"lora_path: adapter_config.json: {alpha_field}: must be a finite number, "
                     f"got {alpha!r}")
    return r, alpha / (r ** 0.5 if config.get("use_rslora") else r)


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (A [r, in], B [out, r]) from peft's file keys: floating matrices."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        head, _, kind = key.removesuffix(".weight").rpartition(".")
        if not key.startswith(_PREFIX) or kind not in ("lora_A", "lora_B") \
                or not key.endswith(".weight"):
            raise _error(f"lora_path: tensor {key!r}: must be a peft LoRA matrix "
                         f"('base_model.model.<module>.lora_A.weight' or lora_B), got that key")
        if not value.is_floating_point() or value.dim() != 2:
            raise _error(f"lora_path: tensor {key!r}: must be a floating-point matrix, got "
                         f"{value.dtype} of shape {list(value.shape)}")
        modules.setdefault(head.removeprefix(_PREFIX), {})[kind] = value
    out = {}
    for module, pair in modules.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise _error(f"lora_path: module {module!r}: must have both lora_A and lora_B, got "
                         f"{sorted(pair)}")
        out[module] = (pair["lora_A"], pair["lora_B"])
    return out


def _scales(config: dict, pairs: dict) -> dict[str, float]:
    """Each module's scale, its matrices' rank checked against the config's."""
    scales = {}
    for module, (a, b) in pairs.items():
        r, scales[module] = _rank_and_scale(config, module)
        if a.shape[0] != r or b.shape[1] != r:
            raise _error(f"lora_path: module {module!r}: lora_A must have r={r} rows and lora_B "
                         f"r={r} columns (adapter_config.json), got A {list(a.shape)} and B "
                         f"{list(b.shape)}")
    return scales


def merged_tensors(params: dict[str, torch.Tensor], base: dict[str, torch.Tensor],
                   pairs: dict, scales: dict[str, float], model: torch.nn.Module | None = None
                   ) -> dict[str, torch.Tensor]:
    """For each adapted module, ``<module>.weight`` = base + scales[module] · B @ A in its
    served dtype (base: the kept base tensor when there is one, else the served one). With
    ``model``, each module must be one of its nn.Linear layers (peft's lora_A/lora_B of an
    embedding or a norm mean something else)."""
    out = {}
    for module, (a, b) in pairs.items():
        name = f"{module}.weight"
        p = params.get(name)
        if p is None or (model is not None and not isinstance(_submodule(model, module),
                                                              torch.nn.Linear)):
            raise _error(f"lora_path: module {module!r}: must be a linear layer of the served "
                         f"model, got " + ("no parameter " + repr(name) if p is None else
                                           type(_submodule(model, module)).__name__))
        scale = scales[module]
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


def _submodule(model: torch.nn.Module, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


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
    pairs = _pairs(tensors)
    merged = merged_tensors(engine.params, base, pairs, _scales(config, pairs), engine.model)
    restore = {n: t for n, t in base.items() if n not in merged}
    for n in merged:
        base.setdefault(n, engine.params[n].data)
    return {**restore, **merged}, _Slot(name, path, {n: base[n] for n in merged}), version


def unload_adapter(engine, slot, payload: dict) -> tuple[dict, int]:
    """/unload_lora_adapter: (the base tensors to swap back in, the version they make); a 400
    when ``lora_name`` is not the adapter in (SGLang answers failed loads and unloads so)."""
    name = payload.get("lora_name")
    if slot is None or slot.name != name:
        raise _error(f"lora_name: must name the loaded adapter "
                     f"({None if slot is None else slot.name!r}), got {name!r}")
    return dict(slot.base), _version(engine, payload)
