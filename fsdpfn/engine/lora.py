"""Low-rank adapters (LoRA) through peft, on the engine's FSDP2 / tensor-parallel model.

Order inside shard_model: skeleton on meta -> ``apply_lora`` (peft injects ``lora_A`` / ``lora_B``
next to each target linear, whose weight moves under ``base_layer``) -> apply_tp (``tp_plan``
gives each adapter matrix its base layer's style) -> FSDP2. The frozen base is kept in the compute
``dtype`` (no float32 master copy of it); only the adapters are trainable, in ``optimizer_dtype``,
so the optimizer, the gradient norm and the optimizer state see adapters alone.

Names. Inside the engine a target weight is ``<module>.base_layer.weight`` and its adapters
``<module>.lora_A.default.weight`` [r, in] and ``<module>.lora_B.default.weight`` [out, r]; the
adapter delta is ``scale · B @ A`` with ``scale = alpha / rank`` (peft's). Everything that leaves
the engine uses outside names: HF names for base and merged weights (``<module>.weight``) and
peft's file names for adapters (``base_model.model.<module>.lora_A.weight``).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from fsdpfn.config import LoRAConfig
from fsdpfn.errors import ConfigError

__all__ = ["ALL_LINEAR", "ADAPTER", "target_names", "apply_lora", "is_adapter", "hf_name",
           "peft_key", "adapter_init", "adapters_disabled", "tp_plan", "MergedWeight",
           "merged_params", "merge_full_state", "adapter_params", "gather_adapters", "peft_config",
           "write_adapter_dir", "scale_of"]

ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's adapter name inside the engine
_A, _B = f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."


def scale_of(cfg: LoRAConfig) -> float:
    """peft's scaling of the adapter delta: alpha / rank."""
    return cfg.alpha / cfg.rank


# ---------------------------------------------------------------- names


def is_adapter(name: str) -> bool:
    """Whether an engine parameter name is an adapter matrix."""
    return _A in name or _B in name


def hf_name(name: str) -> str:
    """The outside (HF) name of a base parameter: ``.base_layer`` dropped."""
    return name.replace(".base_layer.", ".")


def peft_key(name: str) -> str:
    """peft's file key of an adapter matrix (no ``lm.`` prefix, no adapter name)."""
    name = name.removeprefix("lm.")
    return "base_model.model." + name.replace(_A, ".lora_A.").replace(_B, ".lora_B.")


# ---------------------------------------------------------------- building


def target_names(lm: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Leaf names of the linears that get adapters: every nn.Linear inside the decoder layers
    for ``all-linear`` (never lm_head or a critic's score), else ``cfg.target_modules``, each of
    which must name such a linear."""
    present = sorted({name.rsplit(".", 1)[-1] for name, m in lm.model.layers.named_modules()
                      if isinstance(m, nn.Linear)})
    if tuple(cfg.target_modules) == (ALL_LINEAR,):
        return present
    missing = [t for t in cfg.target_modules if t not in present]
    if missing:
        raise ConfigError(f"lora.target_modules: must name linear layers of the decoder layers "
                          f"({present}) or be ['all-linear'], got {missing}")
    return list(cfg.target_modules)


def apply_lora(lm: nn.Module, cfg: LoRAConfig, *, base_dtype: torch.dtype,
               adapter_dtype: torch.dtype) -> None:
    """Inject peft adapters into ``lm`` in place (meta skeleton): the base frozen in
    ``base_dtype``, the adapters trainable in ``adapter_dtype``."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"lora: adapters are built with the peft package, which does not "
                          f"import here ({exc}); pip install peft") from None

    peft_cfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                               target_modules=target_names(lm, cfg), bias="none")
    peft.inject_adapter_in_model(peft_cfg, lm, adapter_name=ADAPTER)
    cast: dict[int, nn.Parameter] = {}  # tied parameters stay one parameter
    for module in lm.modules():
        for key, p in list(module._parameters.items()):  # noqa: SLF001
            if p is None:
                continue
            if id(p) not in cast:
                trainable = p.requires_grad
                dtype = adapter_dtype if trainable else base_dtype
                cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=trainable)
            module._parameters[key] = cast[id(p)]  # noqa: SLF001


def adapter_init(lm: nn.Module, *, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' initial values by engine name (peft's: A ~ kaiming-uniform(a=sqrt 5), i.e.
    U(±1/sqrt(in)); B = 0, so the adapted model starts equal to the base), drawn from ``seed`` in
    the model's order: the same on any mesh."""
    out = {}
    gen = torch.Generator().manual_seed(seed)
    for key, value in lm.state_dict(keep_vars=True).items():
        if _A in key:
            bound = 1.0 / math.sqrt(value.shape[1])
            out[key] = (torch.rand(tuple(value.shape), generator=gen) * 2 - 1) * bound
        elif _B in key:
            out[key] = torch.zeros(tuple(value.shape))
    return out


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block the model runs its base alone (peft's disabled-adapter path); the
    adapters' requires_grad is left untouched (FSDP2 owns those parameters)."""
    layers = _lora_layers(model)
    before = [layer._disable_adapters for layer in layers]  # noqa: SLF001
    try:
        for layer in layers:
            layer._disable_adapters = True  # noqa: SLF001
        yield
    finally:
        for layer, value in zip(layers, before):
            layer._disable_adapters = value  # noqa: SLF001


def tp_plan(layer: nn.Module, plan: dict) -> dict:
    """A decoder layer's tensor-parallel plan for its peft-wrapped linears: the base layer keeps
    its style; a column-parallel (or replicated-kv) layer's B takes the same style (its A stays
    replicated), a row-parallel layer's A takes the row style (its B stays replicated). DTensor
    sums the gradients the replicated matrices need over tp."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for key, style in plan.items():
        module = layer.get_submodule(key)
        if not hasattr(module, "base_layer"):
            out[key] = style
            continue
        out[f"{key}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            out[f"{key}.lora_B.{ADAPTER}"] = style
        elif isinstance(style, RowwiseParallel):
            out[f"{key}.lora_A.{ADAPTER}"] = style
        else:
            raise ConfigError(f"lora.target_modules: {key!r} is tensor-parallel with "
                              f"{type(style).__name__}, which adapters do not support")
    return out


# ---------------------------------------------------------------- leaving the engine


def _whole(p: torch.Tensor, device) -> torch.Tensor:
    """The whole tensor, float32, on ``device`` (a collective for a DTensor)."""
    if hasattr(p, "full_tensor"):
        p = p.detach().full_tensor()
    return p.detach().to(device=device, dtype=torch.float32)


class MergedWeight:
    """A target weight as the outside sees it: base + scale · B @ A (computed when gathered)."""

    def __init__(self, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float):
        self.base, self.a, self.b, self.scale = base, a, b, scale
        self.shape = base.shape

    def full(self, dtype: torch.dtype, device) -> torch.Tensor:
        """Collective (every rank, same order): the whole merged weight in ``dtype``."""
        base, a, b = (_whole(t, device) for t in (self.base, self.a, self.b))
        # out of place: on a one-rank mesh ``base`` may be the live parameter's own storage
        return torch.add(base, b @ a, alpha=self.scale).to(dtype)


def merged_params(named: list[tuple[str, torch.Tensor]], cfg: LoRAConfig) -> list[tuple]:
    """(HF name, tensor or MergedWeight) of a LoRA engine's named parameters (``lm.`` already
    dropped): adapters folded into their base weights, in the base's place."""
    by_name = dict(named)
    out = []
    for name, p in named:
        if is_adapter(name):
            continue
        module = name.removesuffix(".base_layer.weight")
        if name.endswith(".base_layer.weight") and f"{module}{_A}weight" in by_name:
            p = MergedWeight(p, by_name[f"{module}{_A}weight"], by_name[f"{module}{_B}weight"],
                             scale_of(cfg))
        out.append((hf_name(name), p))
    return out


def merge_full_state(full: dict, cfg: LoRAConfig) -> dict:
    """A full (gathered) engine state dict -> the merged model's, under HF names (``lm.``
    kept), each target weight base + scale · B @ A computed in float32."""
    out = {}
    for key, value in full.items():
        if is_adapter(key):
            continue
        module = key.removesuffix(".base_layer.weight")
        if key.endswith(".base_layer.weight") and f"{module}{_A}weight" in full:
            a, b = full[f"{module}{_A}weight"].float(), full[f"{module}{_B}weight"].float()
            value = value.float().add(b @ a, alpha=scale_of(cfg))
        out[hf_name(key)] = value
    return out


def adapter_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(engine name, parameter) of every adapter matrix, in registration order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]


def gather_adapters(model: nn.Module, *, device, keep: bool) -> dict[str, torch.Tensor]:
    """Collective: every adapter matrix whole, float32 on CPU under peft's file keys (on the
    keeping rank; an empty dict elsewhere)."""
    out = {}
    with torch.no_grad():
        for name, p in adapter_params(model):
            whole = _whole(p, device)
            if keep:
                out[peft_key(name)] = whole.cpu()
    return out


def peft_config(cfg: LoRAConfig, lm: nn.Module, *, base_path: str | None):
    """The peft LoraConfig of this engine's adapters (what adapter_config.json holds)."""
    import peft

    peft_cfg = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                               target_modules=sorted(targets_of(lm)), bias="none",
                               task_type="CAUSAL_LM", base_model_name_or_path=base_path)
    return peft_cfg


def targets_of(lm: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in lm.named_modules() if hasattr(m, "lora_A")}


def write_adapter_dir(directory: Path, tensors: dict[str, torch.Tensor], config,
                      dtype: torch.dtype) -> None:
    """peft's adapter layout: adapter_model.safetensors and adapter_config.json."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()},
              str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(directory))
