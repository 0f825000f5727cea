"""The weight files of an HF model directory, torch-free: the refusal of a directory without
safetensors weights, shared by the engine's loader and the recipe's preflight, and the
parameter counts in their headers, which the recipe's memory estimate reads."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

from fsdpfn.errors import ConfigError

__all__ = ["no_safetensors", "counted_params"]


def no_safetensors(key: str, path: str | Path, rule: str) -> ConfigError:
    """The ConfigError for ``path`` (config key ``key``) holding no *.safetensors file; where it
    holds PyTorch's pickled weights (pytorch_model*.bin, *.pt, *.pth), the one-time conversion
    is named: fsdpfn reads safetensors only, tensor by tensor, and never unpickles a file."""
    pickled = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth")
                     for p in Path(path).glob(pattern))
    if not pickled:
        return ConfigError(f"{key}: {rule}, got {str(path)!r} (no .safetensors file)")
    shown = ", ".join(pickled[:3]) + (f" and {len(pickled) - 3} more" if len(pickled) > 3 else "")
    return ConfigError(
        f"{key}: {rule}, got {str(path)!r} (it holds PyTorch weights, {shown}, which fsdpfn "
        f"does not read: convert them once with transformers, AutoModelForCausalLM."
        f"from_pretrained(DIR).save_pretrained(NEW_DIR) and AutoTokenizer.from_pretrained(DIR)"
        f".save_pretrained(NEW_DIR), and use NEW_DIR)")


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def counted_params(path, layers: int) -> tuple[int, int] | None:
    """(a decoder layer's parameters, their mean over the layers; every other parameter) from
    the headers of ``path``'s *.safetensors files (no tensor is read): exact for any family,
    where the formulas count a llama-shaped layer (a GPT-2 or Falcon MLP has two matrices, not
    three). None when the files do not read as ``layers`` numbered layers of floating-point
    tensors (quantized weights, another layout, no files)."""
    per_layer: dict[int, int] = {}
    rest = 0
    files = sorted(Path(path).glob("*.safetensors"))
    for file in files:
        try:
            with open(file, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict) or info.get("dtype") not in _FLOAT_DTYPES:
                return None
            numel = math.prod(info.get("shape") or [1])
            m = _LAYER.search(name)
            if m is None:
                rest += numel
            else:
                per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + numel
    if not files or sorted(per_layer) != list(range(layers)):
        return None
    return sum(per_layer.values()) // layers, rest
