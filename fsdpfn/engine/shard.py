"""shard_model: build the HF model, then apply TP -> activation checkpointing -> compile -> FSDP2,
then weights.

Every rank builds the model on the meta device; parallelism is applied to that skeleton in a
visible order (apply_tp of fsdpfn.engine.tp, apply_ac, apply_compile, apply_fsdp, in place); the
shards are then materialised and filled one tensor at a time by fsdpfn.engine.load_weights (from
the checkpoint, or HF's random init drawn piece by piece: no rank ever holds a full copy). With
``memory_efficient_load`` only rank 0 reads and broadcasts; otherwise every rank reads. Master
weights live in ``optimizer_dtype``; FSDP2 casts to the compute ``dtype`` for forward and
backward and reduces gradients in ``grad_reduce_dtype``. The optimizer and its schedule come
from fsdpfn.engine.optim_build.

Where the build's time went (``EngineConfig.timing``): ``last_timings(state)["shard_model"]``,
seconds per phase: ``time_check`` (config, family checks), ``time_skeleton`` (the meta model),
``time_wrap`` (kernels, LoRA, tp, checkpointing, compile, FSDP2), ``time_materialize`` (the
shards allocated, buffers computed), ``time_weights`` (read or drawn, copied in),
``time_optimizer`` and ``time_total``.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import weakref
from pathlib import Path

from torch import nn

from fsdpfn.engine import attention, cp, families, lora, timing
from fsdpfn.agree import agree_on_error
from fsdpfn.config import EngineConfig
from fsdpfn.errors import ConfigError
from fsdpfn.engine.load_weights import build_skeleton, load_weights, restore_buffers, torch_dtype
from fsdpfn.engine.mesh import Mesh, check_mesh
from fsdpfn.ops.logprobs import vocab_shard_range
from fsdpfn.engine.optim_build import build_optimizer, build_scheduler, lr_factor
from fsdpfn.engine.packed import PackedModel
from fsdpfn.engine.state import EngineState
from fsdpfn.engine.tp import apply_tp, base_model, kv_heads_of_rank
from fsdpfn.wire.kernels import apply_fused_kernels

log = logging.getLogger("fsdpfn")

# apply_tp, kv_heads_of_rank, base_model (fsdpfn.engine.tp), the optimizer builders
# (fsdpfn.engine.optim_build) and apply_fused_kernels (fsdpfn.wire.kernels: the server runs the same
# modules) are re-exported: their home was this module
__all__ = ["shard_model", "load_hf_config", "apply_tp", "apply_ac", "apply_compile", "apply_fsdp",
           "kv_heads_of_rank", "build_optimizer", "build_scheduler", "lr_factor", "base_model",
           "torch_dtype", "build_skeleton", "apply_fused_kernels", "source_config"]


# ---------------------------------------------------------------- config and skeleton


def _read_hf_config(path: Path):
    """transformers' config of the directory ``path``, or a ConfigError naming its config.json
    and why it does not read (not JSON: json's line and column; an unknown model_type)."""
    from transformers import AutoConfig

    try:
        json.loads((path / "config.json").read_text())
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model_path: config.json must be a readable transformers config, "
                          f"got {str(path / 'config.json')!r} ({reason})") from None


def _one_line(exc) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:300] + "..."


def load_hf_config(config: EngineConfig):
    from transformers import AutoConfig

    if config.model_path is not None:
        path = Path(config.model_path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model_path: must be a local HF model directory with config.json, "
                              f"got {config.model_path!r}")
        hf_config = _read_hf_config(path)
        _check_fields(vars(hf_config), type(hf_config),
                      lambda key: f"model_path: {key} in {str(path / 'config.json')!r}")
    else:
        spec = dict(config.model_config)
        model_type = spec.pop("model_type")
        for key in ("architectures", "transformers_version", "_name_or_path"):
            spec.pop(key, None)
        _check_fields(spec, _config_class(model_type), lambda key: f"model_config.{key}:")
        _check_rope_theta(spec)
        try:
            hf_config = AutoConfig.for_model(model_type, **spec)
        except (ValueError, KeyError) as exc:
            if isinstance(exc, KeyError) or "Unrecognized model" in str(exc):
                raise ConfigError(f"model_config.model_type: not a transformers model type, "
                                  f"got {model_type!r} ({exc})") from None
            raise ConfigError(f"model_config: transformers refuses this {model_type} config: "
                              f"{_one_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - transformers' strict config fields (huggingface_hub)
            raise ConfigError(f"model_config: transformers refuses this {model_type} config: "
                              f"{type(exc).__name__}: {_one_line(exc)}") from None
    if config.is_critic:
        hf_config.num_labels = 1
    if config.disable_dropout:
        _zero_dropout_fields(hf_config)
    return hf_config


def _config_class(model_type):
    """transformers' config class of ``model_type`` (None for a type it does not know, which
    AutoConfig.for_model then refuses by name)."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except (KeyError, TypeError):
        return None


def _check_fields(fields: dict, config_class, where) -> None:
    """A text where the config class has a number or a bool (``hidden_size: "big"``), or a
    tensor size that is not an int >= 1, is a ConfigError naming the field (``where(key)``
    begins the message). transformers before its strict config fields took such a value, and
    the model's build failed later in torch with an error naming no field."""
    quiet = logging.getLogger("transformers")  # a default config's own notes are not the user's
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        defaults = vars(config_class()) if config_class is not None else {}
    except Exception:  # noqa: BLE001 - a class without usable defaults: sizes checked alone
        defaults = {}
    finally:
        quiet.setLevel(level)
    for key, value in fields.items():
        default = defaults.get(key)
        if isinstance(value, str) and isinstance(default, (bool, int, float)):
            kind = "true or false" if isinstance(default, bool) else "a number"
            raise ConfigError(f"{where(key)} must be {kind}, as {config_class.__name__}'s "
                              f"default {default!r} is, got {value!r}")
        sizes = value if isinstance(value, (list, tuple)) and value else [value]
        if key in _SIZES and value is not None and not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
            raise ConfigError(f"{where(key)} must be an int >= 1 (or a list of them, one "
                              f"per layer), got {repr(value)[:80]}")


# the sizes of a decoder's tensors (None where a family leaves one to another field; a list
# of one per layer in some, as Gemma-3n's intermediate_size)
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim")


def _check_rope_theta(spec: dict) -> None:
    """``rope_theta`` beside ``rope_parameters`` (a model's ``to_dict()`` with one field
    changed): transformers reads rope_parameters and drops a top-level rope_theta without a
    word, so a changed base would not be the model's. A text there failed in the rotary's
    arithmetic."""
    theta = spec.get("rope_theta")
    if theta is None:
        return
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"model_config.rope_theta: must be a number, got {theta!r}")
    params = spec.get("rope_parameters")
    inner = params.get("rope_theta") if isinstance(params, dict) else None
    if inner is not None and inner != theta:
        raise ConfigError(f"model_config.rope_theta: {theta!r} disagrees with "
                          f"model_config.rope_parameters['rope_theta'] = {inner!r}, which "
                          f"transformers reads instead; set the base in rope_parameters (or "
                          f"give rope_theta alone)")


# config fields that drop activations in training, by their names in transformers' configs:
# attention_dropout, hidden_dropout_prob, residual_dropout (Seed-OSS), attn_pdrop / resid_pdrop
# / embd_pdrop (GPT-2 and kin), layerdrop (whole layers), drop_path_rate, ...
_DROPOUT_FIELD = re.compile(r"dropout|pdrop|layerdrop|drop_path")


# id(hf_config) -> [(its config or text config, field, the model's own value)] of the fields
# _zero_dropout_fields set to 0; an entry leaves with its config (weakref.finalize)
_ZEROED: dict[int, list] = {}


def _zero_dropout_fields(hf_config) -> None:
    """Every dropout-like field of ``hf_config`` (and of its text config) set to 0: families
    apply some of them functionally, outside any nn.Dropout module (Seed-OSS's
    residual_dropout, GPT-BigCode's attn_pdrop, BioGPT's hidden_dropout_prob), so zeroing the
    modules alone left those training with dropout on. The model's own values are kept for
    ``source_config`` (an exported model keeps them)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    zeroed = []
    for cfg in {id(c): c for c in (hf_config, text)}.values():
        for key, value in list(vars(cfg).items()):
            if _DROPOUT_FIELD.search(key) and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and value:
                setattr(cfg, key, 0.0 if isinstance(value, float) else 0)
                zeroed.append((cfg is text and cfg is not hf_config, key, value))
    if zeroed:
        _ZEROED[id(hf_config)] = zeroed
        weakref.finalize(hf_config, _ZEROED.pop, id(hf_config), None)


def source_config(hf_config):
    """A copy of a state's ``hf_config`` as the model's own config has it, for a config.json
    written out (export_hf, a disk push): the dropout fields that ``disable_dropout`` set to 0
    for training at the model's own values again."""
    config = copy.deepcopy(hf_config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for in_text, key, value in _ZEROED.get(id(hf_config), ()):
        setattr(text if in_text else config, key, value)
    return config


def _check_supported(config: EngineConfig, mesh: Mesh) -> None:
    """Options that have a config field but no implementation yet fail loudly, never silently."""
    if config.logprobs_impl == "liger":
        from fsdpfn.ops.logprobs import liger_available

        if config.is_critic or mesh.tp > 1 or not liger_available(mesh.device_type):
            raise ConfigError(f"logprobs_impl: 'liger' needs an actor on CUDA with tp=1 and "
                              f"liger-kernel installed, got 'liger' with device type "
                              f"{mesh.device_type!r}, tp={mesh.tp}, is_critic={config.is_critic}")
    if config.compile and mesh.tp > 1:
        raise ConfigError(f"compile: the compiled decoder blocks run with tp=1 only (dp and cp "
                          f"any), got compile=True with tp={mesh.tp}")
    if config.attn_impl == "varlen" and mesh.device_type != "cuda":
        raise ConfigError(f"attn_impl: 'varlen' needs CUDA, got device type "
                          f"{mesh.device_type!r} (use 'auto' or 'sdpa')")


def _check_divisibility(hf_config, mesh: Mesh) -> None:
    """What tp must divide: the query heads and the MLP width; cp must divide each tp rank's
    query heads. The vocabulary is split unevenly (no padding rows) and kv heads fewer than tp
    (or cp), or not divisible by it, are replicated."""
    tp = mesh.tp
    heads = hf_config.num_attention_heads
    if mesh.cp > 1 and heads % tp == 0 and (heads // tp) % mesh.cp:
        raise ConfigError(f"ParallelStrategy.cp: must divide the query heads of each tp rank "
                          f"(num_attention_heads / tp), got cp={mesh.cp} and "
                          f"num_attention_heads / tp = {heads} / {tp}")
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(hf_config, name, None)  # Falcon names its MLP width ffn_hidden_size
        if value is not None and value % tp:
            raise ConfigError(f"ParallelStrategy.tp: must divide the model's {name}, got "
                              f"tp={tp} and {name}={value}")
    vocab = hf_config.vocab_size
    start, stop = vocab_shard_range(vocab, tp, tp - 1)
    if stop == start:  # only for vocabularies of at most tp*(tp-1) tokens
        raise ConfigError(f"ParallelStrategy.tp: every tensor-parallel rank must hold at least "
                          f"one vocabulary row (ceil(vocab_size / tp) rows each), got tp={tp} "
                          f"and vocab_size={vocab}, which leaves the last rank none")


def _note_head_fallback(lm: nn.Module, hf_config, config: EngineConfig) -> None:
    """Liger's fused head computes plain h @ W.T: a model whose head caps its logits or adds a
    bias takes the chunked head (which applies both); say so once."""
    head = lm.get_output_embeddings()
    capped = getattr(hf_config, "final_logit_softcapping", None)
    biased = head is not None and getattr(head, "bias", None) is not None
    if config.logprobs_impl == "liger" and not config.is_critic and (capped or biased):
        log.info("logprobs_impl 'liger': %r's head %s, which Liger's fused head does not "
                 "compute; the chunked head runs instead", hf_config.model_type,
                 "caps its logits" if capped else "adds a bias")


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


# ---------------------------------------------------------------- parallelism, in order


def apply_ac(model: nn.Module, config: EngineConfig) -> None:
    """Activation checkpointing of every decoder layer (non-reentrant)."""
    if config.gradient_checkpointing:
        # the recomputation sees the packed keywords its layer's forward saw (attention.py)
        kwargs = {"use_reentrant": False, "context_fn": attention.recompute_context}
        try:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        except ValueError as exc:  # a family whose modeling code has no checkpointing (CTRL)
            raise ConfigError(f"gradient_checkpointing: model_type "
                              f"{getattr(model.config, 'model_type', '?')!r} does not support "
                              f"it ({exc}); must be False for this model, got True") from None


def apply_compile(model: nn.Module, config: EngineConfig) -> int:
    """Regional compilation: each decoder block (the wrap_policy classes) runs the model's own
    forward through ``torch.compile``, set on the instance (``_compiled_forward``). FSDP2's hooks
    stay in the module's ``__call__``, outside the graph, and the attention function is excluded
    from it (fsdpfn.engine.attention.register). Blocks of one class share their compiled code:
    parameters are graph inputs, so the first block's compile serves them all, and the packed
    length turns dynamic at its second value. Returns the number of blocks compiled."""
    if not config.compile:
        return 0
    import inspect

    import torch

    classes = _wrap_classes(model, config)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    compiled = {}  # one compiled function per block class
    for block in blocks:
        kind = type(block)
        if kind not in compiled:
            compiled[kind] = torch.compile(inspect.unwrap(kind.forward))
        block.forward = _compiled_forward(block, compiled[kind])
    return len(blocks)


def _compiled_forward(block: nn.Module, compiled):
    """The block's forward through ``compiled`` (torch.compile of its class's own forward), with
    activation checkpointing kept outside it.

    transformers wraps a block's forward in decorators whose code every family shares (keyword
    deprecation, and on recent versions the checkpointing itself); compiling those would key
    every family's graphs to one code object and exhaust dynamo's recompile limit. So the
    model's own function is compiled, and where transformers checkpoints in ``forward`` (not in
    ``__call__``) the same checkpointing runs here, around the compiled call."""
    from functools import partial

    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    checkpoints_here = isinstance(block, GradientCheckpointingLayer) and \
        "__call__" not in GradientCheckpointingLayer.__dict__

    def forward(*args, **kwargs):
        if checkpoints_here and block.gradient_checkpointing and block.training and \
                torch.is_grad_enabled():
            return block._gradient_checkpointing_func(partial(compiled, block, **kwargs), *args)
        return compiled(block, *args, **kwargs)

    forward.compiled = compiled
    return forward


def _wrap_classes(model: nn.Module, config: EngineConfig) -> tuple[str, ...]:
    names = config.fsdp.wrap_policy or tuple(getattr(model, "_no_split_modules", None) or ())
    # the critic's head and the lm_head stay with the root
    present = {type(m).__name__ for m in model.modules()}
    if config.fsdp.wrap_policy is not None:
        missing = [n for n in names if n not in present]
        if missing:
            raise ConfigError(f"fsdp.wrap_policy: must name module classes of the model, got "
                              f"{missing} (the model has e.g. "
                              f"{sorted(n for n in present if 'Layer' in n)})")
    return tuple(n for n in names if n in present)


def apply_fsdp(model: nn.Module, mesh: Mesh, config: EngineConfig) -> None:
    """FSDP2 per decoder layer (wrap_policy classes) then the root, over the dp×cp mesh."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(config.dtype),
                              reduce_dtype=torch_dtype(config.grad_reduce_dtype))
    kwargs = dict(mesh=mesh.fsdp_mesh, mp_policy=mp,
                  reshard_after_forward=config.fsdp.reshard_after_forward)
    if config.fsdp.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    classes = _wrap_classes(model.lm, config)
    for module in model.modules():
        if type(module).__name__ in classes:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        # losses are sums over a global normaliser: gradients must be summed, not averaged
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


# ---------------------------------------------------------------- the public function


def shard_model(config: EngineConfig, mesh: Mesh) -> EngineState:
    """Build (or load) the HF model of ``config`` and shard it over ``mesh``; see module doc."""
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config: must be an EngineConfig, got {type(config).__name__}")
    check_mesh(mesh)
    phases = timing.Phases(mesh.device)  # where the build's time goes: last_timings(state)
    error = None
    try:  # every rank validates before the first collective; all agree on the verdict
        _check_supported(config, mesh)
        hf_config = load_hf_config(config)
        families.check_model(hf_config, verify_model=config.verify_model,
                             is_critic=config.is_critic, device=mesh.device,
                             fused_kernels=config.fused_kernels and not config.compile,
                             tp=mesh.tp)
        _check_divisibility(hf_config, mesh)
    except ConfigError as exc:
        error = exc
    agree_on_error(mesh, error)
    phases.mark("check")
    cp.register()
    hf_config._attn_implementation = cp.attn_name(mesh.cp)
    dtype = torch_dtype(config.optimizer_dtype)
    try:  # the same config on every rank: each raises the same error, before any collective
        lm = build_skeleton(hf_config, is_critic=config.is_critic, dtype=dtype, device="meta")
    except KeyError as exc:  # verify_model='never' on a family with an attention table of its own
        own_table = families.attention_table_error(hf_config.model_type, exc)
        if own_table is None:
            raise
        raise own_table from None
    families.check_structure(lm, model_type=hf_config.model_type, is_critic=config.is_critic,
                             lora=config.lora is not None)
    phases.mark("skeleton")
    if config.disable_dropout:
        _disable_dropout(lm)
    if config.fused_kernels and not config.compile:  # compiled blocks fuse their own
        apply_fused_kernels(lm, hf_config, mesh.device_type, mlp=config.lora is None)
    if config.lora is not None:  # before tp and FSDP2: the base frozen in the compute dtype
        lora.apply_lora(lm, config.lora, base_dtype=torch_dtype(config.dtype), adapter_dtype=dtype)
    apply_tp(lm, mesh)
    apply_ac(lm, config)
    apply_compile(lm, config)
    model = PackedModel(lm, is_critic=config.is_critic)
    model.compute_dtype = torch_dtype(config.dtype)
    model.use_varlen = config.attn_impl != "sdpa"
    model.logprobs_impl = config.logprobs_impl
    _note_head_fallback(lm, hf_config, config)
    if mesh.tp > 1:
        model.tp_group = mesh.group("tp")
    if mesh.cp > 1:
        model.cp_group = mesh.group("cp")
    apply_fsdp(model, mesh, config)
    phases.mark("wrap")
    model.to_empty(device="cpu" if config.fsdp.offload_params else mesh.device)
    restore_buffers(lm, hf_config, is_critic=config.is_critic, dtype=dtype, device=mesh.device)
    phases.mark("materialize")
    load_weights(model, hf_config, config, mesh)  # checks, agrees, then fills the shards
    phases.mark("weights")
    optimizer = scheduler = None
    if config.optimizer is not None:
        optimizer = build_optimizer(model, config.optimizer, master_dtype=config.optimizer_dtype,
                                    per_layer=config.fsdp.per_layer_optim_step,
                                    prefetch_layers=config.fsdp.optim_step_prefetch_layers,
                                    device=mesh.device)
        scheduler = build_scheduler(optimizer, config.optimizer)
    else:
        for param in model.parameters():
            param.requires_grad_(False)
    phases.mark("optimizer")
    state = EngineState(config=config, mesh=mesh, model=model, optimizer=optimizer,
                        scheduler=scheduler, step=0, version=0, hf_config=hf_config)
    if config.timing:
        timing.keep(model, "shard_model", phases.numbers())
    return state
