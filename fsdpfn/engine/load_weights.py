"""The starting weights of a sharded model, filled in one tensor at a time.

The full (unsharded) weights come from an HF directory's safetensors files (read tensor by tensor
through safetensors' lazy reader) or from HF's own random init under ``EngineConfig.seed``, drawn
one piece of the model at a time (the embedding, each decoder layer, the final norm, the head).
Each full tensor is cast to its parameter's dtype, cut to this rank's shard and copied in, then
dropped. So a rank holds its shards plus one piece of full weights, never a full copy of the
model: a 32B LoRA base builds in its own 65 GB of bf16 (a full fp32 copy would be 131 GB).

With ``memory_efficient_load`` only rank 0 reads (or draws) and broadcasts each tensor in its
parameter's dtype; otherwise every rank reads the same values and cuts its own shard. Every
problem a checkpoint can have (a missing weight, a wrong shape) is found from the files' headers
before the first tensor is copied, and all ranks agree on the verdict: a bad checkpoint leaves
nothing half-loaded and no rank waiting.

Names: the engine's parameter names are HF's, except LoRA's (``.base_layer.`` inserted, the
adapters' own matrices, drawn like peft's from ``seed``). A checkpoint name that transformers
renames on load (its conversion mapping: GPT-NeoX's ``embed_out`` is the module ``lm_head``) is
read under the checkpoint's name. A tied lm_head that a checkpoint leaves
out takes the embedding; a critic's value head missing from a causal-LM checkpoint starts small
(N(0, 0.02²) under ``seed``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdpfn.engine import lora
from fsdpfn.agree import agree_on_error, is_rank_zero, world_size
from fsdpfn.errors import ConfigError
from fsdpfn.engine.weight_files import no_safetensors

log = logging.getLogger("fsdpfn")

__all__ = ["load_weights", "build_skeleton", "restore_buffers", "torch_dtype", "DiskWeights",
           "RandomWeights"]


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_skeleton(hf_config, *, is_critic: bool, dtype: torch.dtype, device) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if is_critic else AutoModelForCausalLM
    with torch.device(device):
        model = auto.from_config(hf_config, dtype=dtype)
        # transformers 5.0 does not tie the head to the embeddings when it builds (5.1 does)
        # on the meta device; from_pretrained ties them after loading, so do the same here
        model.tie_weights()
    return model


def _computed_buffers(hf_config, *, is_critic: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """name -> value of every non-persistent buffer of ``hf_config``'s model, computed by HF's
    own ``_init_weights`` (what ``from_pretrained`` runs for them) on a meta skeleton whose
    buffer-owning modules alone get real (CPU) buffers; parameters stay on meta, untouched."""
    ref = build_skeleton(hf_config, is_critic=is_critic, dtype=dtype, device="meta")
    names = [name for name, _ in ref.named_non_persistent_buffers()]
    for prefix in sorted({name.rpartition(".")[0] for name in names}):
        module = ref.get_submodule(prefix)
        for name in module._non_persistent_buffers_set:  # noqa: SLF001 - torch's own record
            buffer = module._buffers.get(name)  # noqa: SLF001
            if buffer is not None:
                module._buffers[name] = torch.full_like(buffer, _unset(buffer.dtype),  # noqa: SLF001
                                                        device="cpu")
        for param in module.parameters(recurse=False):
            param._is_hf_initialized = True  # HF's init functions skip it
        with torch.no_grad():
            ref._init_weights(module)  # noqa: SLF001 - HF's own init, per module
    return {name: ref.get_buffer(name) for name in names}


def _unset(dtype: torch.dtype):
    """What a buffer holds before HF's init computes it: NaN, or an integer's least value (an
    int64 ``position_ids`` cannot hold NaN); a bool buffer cannot be told unset."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _is_unset(value: torch.Tensor) -> bool:
    if value.dtype == torch.bool:
        return False
    if value.is_floating_point() or value.is_complex():
        return bool(torch.isnan(value).any())
    return bool((value == _unset(value.dtype)).any())


def restore_buffers(lm: nn.Module, hf_config, *, is_critic: bool, dtype: torch.dtype,
                    device) -> None:
    """Fill the non-persistent buffers of ``lm`` (rotary frequencies of every layer type,
    embedding scales, ...: in no checkpoint, garbage after the meta build) with the values the
    model's own loading gives them; see _computed_buffers. A buffer HF's init leaves unset is
    refused by name rather than left holding garbage."""
    for name, value in _computed_buffers(hf_config, is_critic=is_critic, dtype=dtype).items():
        if _is_unset(value):
            raise ConfigError(f"model_config.model_type: {hf_config.model_type!r} keeps buffer "
                              f"{name!r} outside its checkpoint and its init does not compute "
                              f"it; this family is not supported")
        prefix, _, leaf = name.rpartition(".")
        try:
            owner = lm.get_submodule(prefix)
        except AttributeError:
            continue
        old = owner._buffers.get(leaf)  # noqa: SLF001
        if old is not None:
            owner._buffers[leaf] = value.to(device=device, dtype=old.dtype)  # noqa: SLF001


def _open_safetensors(file: Path):
    """safetensors' lazy reader of ``file`` (it checks the header against the file's size), or
    a ConfigError naming the file and safetensors' reason (a truncated or corrupt file)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"model_path: each *.safetensors file must be a readable safetensors "
                          f"file, got {str(file)!r} ({exc})") from None


class DiskWeights:
    """The tensors of an HF directory's safetensors files, read one at a time (headers only until
    a tensor is asked for)."""

    def __init__(self, path: str | Path):
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise no_safetensors("model_path", path, "must hold *.safetensors weights")
        self._handles = [_open_safetensors(f) for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self):
        return self._where.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def close(self) -> None:
        self._handles, self._where = [], {}


class RandomWeights:
    """HF's random init of ``hf_config``, drawn piece by piece (in module order) on ``device`` in
    ``dtype``: only the piece being read is materialised (plus the tensors tied to a later name,
    kept until that name is read)."""

    def __init__(self, hf_config, *, is_critic: bool, dtype: torch.dtype, device, seed: int):
        torch.manual_seed(seed)
        if torch.device(device).type == "cuda":
            torch.cuda.manual_seed(seed)
        self._model = build_skeleton(hf_config, is_critic=is_critic, dtype=dtype, device="meta")
        self._device = device
        self._shapes = {k: tuple(t.shape) for k, t in
                        self._model.state_dict(keep_vars=True).items()}
        self._pieces = list(_pieces(self._model))
        self._piece_of, first = {}, {}
        for index, (prefix, module, recurse) in enumerate(self._pieces):
            for name, tensor in _named_state(module, recurse):
                key = f"{prefix}.{name}" if prefix else name
                self._piece_of[key] = index
                first.setdefault(id(tensor), key)
        # a name whose tensor is another's (tied embeddings) reads that other name's values
        self._alias = {k: first[id(t)] for k, t in self._model.state_dict(keep_vars=True).items()
                       if first.get(id(t), k) != k}
        self._tied = set(self._alias.values())
        self._kept: dict[str, torch.Tensor] = {}
        self._current, self._values = None, {}

    def __contains__(self, key: str) -> bool:
        return self._alias.get(key, key) in self._piece_of

    def keys(self):
        return self._piece_of.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def get(self, key: str) -> torch.Tensor:
        key = self._alias.get(key, key)
        if key in self._kept:
            return self._kept[key]
        index = self._piece_of[key]
        if index != self._current:
            self._draw(index)
        value = self._values[key]
        if key in self._tied:
            self._kept[key] = value
        return value

    def _draw(self, index: int) -> None:
        self._release()
        prefix, module, recurse = self._pieces[index]
        module.to_empty(device=self._device, recurse=recurse)
        for _, tensor in _named_state(module, recurse):  # HF skips tensors marked initialised
            if hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized
        with torch.no_grad():
            for sub in (module.modules() if recurse else [module]):
                self._model._init_weights(sub)  # noqa: SLF001 - HF's own init, per module
        self._current = index
        self._values = {(f"{prefix}.{n}" if prefix else n): t.detach()
                        for n, t in _named_state(module, recurse)}

    def _release(self) -> None:
        if self._current is not None:
            _, module, recurse = self._pieces[self._current]
            module.to_empty(device="meta", recurse=recurse)
        self._current, self._values = None, {}

    def close(self) -> None:
        self._release()
        self._kept = {}


def _named_state(module: nn.Module, recurse: bool):
    """(name, tensor) of the module's state dict entries (parameters and persistent buffers)."""
    return module.state_dict(keep_vars=True).items() if recurse else [
        (n, t) for n, t in module.state_dict(keep_vars=True).items() if "." not in n]


def _pieces(module: nn.Module, prefix: str = ""):
    """(prefix, module, recurse) in module order: each child holding no ModuleList whole, each
    item of a ModuleList, and a module's own direct tensors alone."""
    if any("." not in n for n in module.state_dict(keep_vars=True)):
        yield prefix, module, False
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if any(isinstance(m, nn.ModuleList) for m in child.modules()):
            yield from _pieces(child, full)
        else:
            yield full, child, True


# ---------------------------------------------------------------- the plan


def _module_key(lm: nn.Module, module: nn.Module | None) -> str | None:
    """The state-dict name of ``module``'s weight inside ``lm`` (None: no such module)."""
    name = next((n for n, m in lm.named_modules() if m is module), None) if module else None
    return None if name is None else lora.hf_name(f"{name}.weight" if name else "weight")


def _tied_names(lm: nn.Module) -> tuple[str | None, str | None]:
    """(head weight, input embedding weight) names, found from the model (``lm_head``,
    ``embed_out``, ...), not assumed."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    embed = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    return _module_key(lm, head), _module_key(lm, embed)


def _renamed_sources(lm: nn.Module, source) -> dict[str, str]:
    """The model's name -> the source's name, for the source names that transformers renames
    when it loads this model (its checkpoint conversion mapping: GPT-NeoX's ``embed_out.`` is
    the model's ``lm_head.``, legacy names of other families). Renamings only: a source name
    that a converter would merge, split or permute is not mapped (the weight is then missing by
    name, and the error says so). Empty where this transformers has no such mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # transformers without conversion mappings: names are the model's
        return {}
    try:  # these helpers are transformers' internals, whose signatures move between releases
        transforms = get_model_conversion_mapping(lm) or []
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        out = {}
        for name in (source.keys() if renamings else ()):
            renamed, _ = rename_source_key(name, renamings, [])
            if renamed != name:
                out.setdefault(renamed, name)
        return out
    except Exception as exc:  # noqa: BLE001 - then the names are the model's, as before
        log.warning("transformers' checkpoint renamings could not be read (%s: %s); the "
                    "checkpoint's names must be the model's", type(exc).__name__, exc)
        return {}


def _source_key(key: str, source, hf_config, tied: tuple = (None, None),
                renamed: dict | None = None) -> str | None:
    """The source's name for the engine's parameter ``key`` (None: drawn here, not read).
    A tied head that the source leaves out reads the input embedding (``tied``: their names);
    ``renamed``: the names transformers' loader would rename (_renamed_sources)."""
    name = lora.hf_name(key)
    if name in source:
        return name
    if renamed and name in renamed:
        return renamed[name]
    head, embed = tied
    if head is not None and name == head and getattr(hf_config, "tie_word_embeddings", False):
        if embed is not None and embed in source:
            return embed
        suffix = embed.rpartition(".")[0].rpartition(".")[2] if embed else "embed_tokens"
        found = next((k for k in source.keys() if k.endswith(f"{suffix}.weight")), None)
        if found is not None:
            return found
    return None


def _plan(lm: nn.Module, source, adapters: dict, config, hf_config) -> dict[str, object]:
    """Engine name -> the source's name, or a tensor drawn here (adapters, a fresh value head).
    Raises ConfigError for a weight the source lacks or has in another shape."""
    plan, missing = {}, []
    tied = _tied_names(lm)
    state = lm.state_dict(keep_vars=True)
    # transformers' renamings of this family's checkpoint names, where the source's names are
    # not the model's (read only then: a checkpoint saved from the model needs none)
    renamed = (_renamed_sources(lm, source) if isinstance(source, DiskWeights) and any(
        k not in adapters and lora.hf_name(k) not in source for k in state) else None)
    for key, target in state.items():
        if key in adapters:
            plan[key] = adapters[key]
            continue
        name = _source_key(key, source, hf_config, tied, renamed)
        if name is None and config.is_critic and key.startswith("score."):
            gen = torch.Generator().manual_seed(config.seed)
            # a fresh value head: small weights, so initial values are near zero
            plan[key] = torch.randn(tuple(target.shape), generator=gen) * 0.02
            continue
        if name is None:
            missing.append(key)
            continue
        if source.shape(name) != tuple(target.shape):
            raise ConfigError(f"model_path: weight {name!r} must have shape "
                              f"{tuple(target.shape)} for this model config, got "
                              f"{source.shape(name)}")
        plan[key] = name
    if missing:
        raise ConfigError(f"model_path: the checkpoint lacks weights the model needs, got none "
                          f"for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return plan


# ---------------------------------------------------------------- the copy


def _copy_in(target: torch.Tensor, full: torch.Tensor | None, device, broadcast: bool) -> None:
    """The full tensor ``full`` (None on ranks that receive it) into ``target``'s shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if broadcast:
        buf = (full.to(device=device, dtype=target.dtype).contiguous() if full is not None
               else torch.empty(tuple(target.shape), dtype=target.dtype, device=device))
        dist.broadcast(buf, src=0)
    else:
        buf = full.to(device=device, dtype=target.dtype)
    with torch.no_grad():
        if isinstance(target, DTensor):
            # every rank holds the same full tensor: each cuts its own shard, no communication
            target.copy_(distribute_tensor(buf, target.device_mesh, target.placements,
                                           src_data_rank=None))
        else:
            target.copy_(buf)


def load_weights(model: nn.Module, hf_config, config, mesh) -> None:
    """Fill ``model`` (a PackedModel whose shards are materialised) with the weights of
    ``config.model_path``, or HF's random init under ``config.seed``; see the module doc."""
    lm = model.lm
    broadcast = config.fsdp.memory_efficient_load and world_size() > 1
    reads = not broadcast or is_rank_zero()
    dtype = torch_dtype(config.optimizer_dtype)
    source = plan = error = None
    try:
        if reads:
            source = (DiskWeights(config.model_path) if config.model_path else
                      RandomWeights(hf_config, is_critic=config.is_critic, dtype=dtype,
                                    device=mesh.device, seed=config.seed))
            adapters = (lora.adapter_init(lm, seed=config.seed) if config.lora is not None
                        else {})
            plan = _plan(lm, source, adapters, config, hf_config)
    except ConfigError as exc:
        error = exc
    agree_on_error(mesh, error)
    try:
        for key, target in lm.state_dict(keep_vars=True).items():
            full = None
            if reads:
                how = plan[key]
                full = how if isinstance(how, torch.Tensor) else source.get(how)
            _copy_in(target, full, mesh.device, broadcast)
    finally:
        if source is not None:
            source.close()
