"""The weight files of an HF model directory, torch-free: the refusal of a directory without
safetensors weights, shared by the engine's loader and the recipe's preflight."""

from __future__ import annotations

from pathlib import Path

from fsdpfn.errors import ConfigError

__all__ = ["no_safetensors"]


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
