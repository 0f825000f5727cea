"""The recipes' ``engine:`` section: an EngineConfig in YAML, less what the recipe owns.

    engine:                              # the policy's engine (every EngineConfig field)
      dtype: auto                        # auto: float32 on CPU, bfloat16 on CUDA
      gradient_checkpointing: true
      optimizer_dtype: bfloat16
      mb_spec: {max_tokens_per_mb: null} # null: the automatic budget
      fsdp: {per_layer_optim_step: true}
      lora: {rank: 16}
    critic_engine:                       # ppo: only what differs from engine:
      fsdp: {offload_params: true}
    ref_engine:                          # grpo, ppo, dpo: the reference model
      fsdp: {offload_params: true}

The section's fields are generated from ``fsdpfn.EngineConfig``'s own (same names, nesting,
defaults and validators), so a field added to EngineConfig appears here without this module
naming it. The fields the recipe sets itself (``OWNED``) are refused with a pointer to their
home. ``critic_engine`` / ``ref_engine`` hold overrides only: each field not written there is
the policy's (a critic never takes the policy's ``lora``; the reference has no optimizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from fsdpfn.config import EngineConfig, OptimizerConfig
from fsdpfn.validators import one_of
from fsdpfn.errors import ConfigError

__all__ = ["EngineSection", "OWNED", "MOVED", "resolve_section", "build_engine",
           "section_dtype", "shard", "yaml_named"]

# EngineConfig fields a recipe sets itself -> where the YAML sets them
OWNED = {
    "model_path": "model.path (the recipe loads the model, or its warm-up result, from there)",
    "model_config": "model.path with model.random_init: true (or the embedded model: fields)",
    "is_critic": "the recipe (ppo's critic and the rw model are critics)",
    "seed": "seed (top level)",
    "optimizer": "optimizer (top level; ppo's critic: critic_optimizer; the warm-up: "
                 "warmup.optimizer)",
}
# recipe keys that moved into engine: (one home per setting)
MOVED = {"mb_spec": "engine.mb_spec", "lora": "engine.lora", "dtype": "engine.dtype",
         "gradient_checkpointing": "engine.gradient_checkpointing",
         "fsdp": "engine.fsdp"}


def _section_fields() -> dict:
    attrs.resolve_types(EngineConfig)
    out = {}
    for a in attrs.fields(EngineConfig):
        if a.name in OWNED:
            continue
        if a.name == "dtype":  # the recipe resolves auto by device (placement.resolve_dtype)
            out[a.name] = attrs.field(default="auto", type=str,
                                      validator=one_of("auto", "bfloat16", "float32"))
            continue
        default = attrs.Factory(a.default.factory) if isinstance(a.default, attrs.Factory) \
            else a.default
        out[a.name] = attrs.field(default=default, validator=a.validator, converter=a.converter,
                                  type=a.type)
    return out


EngineSection = attrs.make_class("EngineSection", _section_fields(), frozen=True)
EngineSection.__doc__ = ("A recipe's engine: EngineConfig's fields less OWNED (see "
                         "fsdpfn.app.recipes.engine).")
EngineSection.__module__ = __name__
# read by fsdpfn.serde when a key is unknown: a pointer instead of a bare refusal
EngineSection.__fsdpfn_moved__ = {k: f"set by {v}" for k, v in OWNED.items()}


def optimizer_homes(where: str = "optimizer", also: tuple = ()) -> dict:
    """{an OptimizerConfig field: where a recipe sets it}: ``engine.lr`` or a top-level ``lr``
    is named with ``optimizer.lr`` rather than refused with a look-alike key ('lora').
    ``also``: (label, section) pairs of other optimizers the same file may mean."""
    def home(name: str) -> str:
        more = "; ".join(f"{label}: {section}.{name}" for label, section in also)
        return f"set by {where}.{name}" + (f" ({more})" if more else "")

    return {a.name: home(a.name) for a in attrs.fields(OptimizerConfig)}


EngineSection.__fsdpfn_moved__.update(
    {k: v for k, v in optimizer_homes(also=(("ppo's critic", "critic_optimizer"),
                                           ("the warm-up", "warmup.optimizer"))).items()
     if k not in attrs.fields_dict(EngineSection)})


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_section(policy, overrides: dict, name: str):
    """The EngineSection of ``name`` (critic_engine / ref_engine): the policy's fields with
    ``overrides`` merged in (mappings merge key by key); the critic and the reference never
    inherit the policy's ``lora``. ConfigError names ``name.key``."""
    from fsdpfn import serde
    if not isinstance(overrides, dict):
        raise ConfigError(f"{name}: must be a mapping of engine fields, got {overrides!r}")
    if overrides.get("lora") is not None:
        why = ("a critic trains in full" if name == "critic_engine" else
               "the reference is frozen; with engine.lora it is the policy with its adapters "
               "disabled")
        raise ConfigError(f"{name}.lora: must be null ({why}), got {overrides['lora']!r}")
    base = serde.unstructure(policy)
    base["lora"] = None
    try:
        return serde.structure(_merge(base, overrides), EngineSection)
    except ConfigError as exc:
        raise _under(name, exc) from None


def check_engine(section, name: str) -> None:
    """EngineConfig's own cross-field rules on a section, before any rank starts."""
    fields = {a.name: getattr(section, a.name) for a in attrs.fields(EngineSection)}
    fields["dtype"] = "float32" if fields["dtype"] == "auto" else fields["dtype"]
    try:
        EngineConfig(model_path="model", **fields)
    except ConfigError as exc:
        raise _under(name, exc) from None


def _under(name: str, exc: ConfigError) -> ConfigError:
    """``exc`` of a section's own keys named under the section ``name`` (``name.key: ...``, or
    ``name: unknown key(s) ...`` where the message names no key of its own)."""
    message = str(exc)
    if message.startswith("unknown key(s)"):
        return ConfigError(f"{name}: {message}")
    return ConfigError(f"{name}.{message}")


def section_dtype(section, device: str) -> str:
    """``auto``: float32 on the CPU, bfloat16 on CUDA."""
    if section.dtype != "auto":
        return section.dtype
    return "bfloat16" if device == "cuda" else "float32"


def build_engine(section, *, model_path, device: str, optimizer, seed: int,
                 critic: bool = False) -> EngineConfig:
    """The EngineConfig of one model of a run: the section's fields plus what the recipe owns."""
    fields = {a.name: getattr(section, a.name) for a in attrs.fields(EngineSection)}
    fields["dtype"] = section_dtype(section, device)
    if critic:
        fields["lora"] = None
    return EngineConfig(**model_source(model_path), optimizer=optimizer, is_critic=critic,
                        seed=seed, **fields)


def shard(config: EngineConfig, mesh, role: str = "engine"):
    """``fsdpfn.shard_model`` on a rank of the main job, its ConfigError named as the YAML
    names the setting (``yaml_named``)."""
    import fsdpfn as ff

    try:
        return ff.shard_model(config, mesh)
    except ConfigError as exc:
        raise yaml_named(role, exc) from exc


# the leading name of a shard_model ConfigError -> the YAML key that sets it
_YAML_HOME = {"ParallelStrategy.": "parallel.", "model_path": "model.path",
              "model_config.": "model.path: config.json: ", "model_type": "model.path: model_type"}


def yaml_named(role: str, exc: ConfigError) -> ConfigError:
    """A ConfigError raised by the engine for one of ``role``'s fields (``fsdp.wrap_policy:
    ...``) renamed under its section (``engine.fsdp.wrap_policy: ...``); one about parallelism
    or the model under ``parallel.`` or ``model.path``; any other unchanged."""
    message = str(exc)
    head = message.split(":", 1)[0].split(".", 1)[0].strip()
    if head in {a.name for a in attrs.fields(EngineSection)}:
        return _under(role, exc)
    for engine_name, yaml_name in _YAML_HOME.items():
        if message.startswith(engine_name):
            return ConfigError(yaml_name + message[len(engine_name):])
    return exc


def model_source(model_path) -> dict:
    """``model_path=``, or ``model_config=`` (its config.json) for a directory without weights
    (``model.random_init``: the engine draws HF's init on its devices under its seed)."""
    from fsdpfn.app.recipes.model import has_weights

    path = Path(model_path)
    if has_weights(path) or not (path / "config.json").is_file():
        return {"model_path": str(path)}
    return {"model_config": json.loads((path / "config.json").read_text())}


# ---------------------------------------------------------------- a recipe's engines


def has_ref(cfg) -> bool:
    return cfg.recipe in ("grpo", "ppo", "dpo")


def engines(cfg) -> dict:
    """{yaml key: EngineSection} of every model the recipe builds: the policy (``engine``),
    the reference (``ref_engine``, unless engine.lora makes it the policy without adapters)
    and ppo's critic (``critic_engine``)."""
    out = {"engine": cfg.engine}
    if has_ref(cfg) and cfg.engine.lora is None:
        out["ref_engine"] = resolve_section(cfg.engine, cfg.ref_engine, "ref_engine")
    if cfg.recipe == "ppo":
        out["critic_engine"] = resolve_section(cfg.engine, cfg.critic_engine, "critic_engine")
    return out


def longest_row(cfg) -> tuple[int, str]:
    """(tokens, how) of the longest row the data allows: prompt limit + response limit for data
    files, the longest problem + answer on the embedded task."""
    if cfg.data.from_files:
        d = cfg.data
        return (d.max_prompt_tokens + d.max_response_tokens,
                f"data.max_prompt_tokens + data.max_response_tokens = {d.max_prompt_tokens} + "
                f"{d.max_response_tokens}")
    t = cfg.task
    prompt = 1 + 2 * t.digits + 2  # <bos> a + b =
    return prompt + t.max_answer_tokens, f"the task's longest row ({t.digits}-digit addition)"


def check_budget(cfg, name: str, section) -> None:
    """An explicit micro-batch budget must hold the longest unit the data allows (a row; a
    chosen + rejected pair for rw and dpo), per context-parallel rank; else the run would stop
    at its first long row. The automatic budget (null) never refuses a row."""
    budget = section.mb_spec.max_tokens_per_mb
    if budget is None:
        return
    row, how = longest_row(cfg)
    unit, what = (2 * row, f"2 x ({how}) (a pair is kept whole)") \
        if cfg.recipe in ("rw", "dpo") else (row, how)
    cp = cfg.parallel.cp
    need = -(-unit // cp)
    if budget < need:
        per = f" / parallel.cp {cp}" if cp > 1 else ""
        raise ConfigError(f"{name}.mb_spec.max_tokens_per_mb: must be >= {what}{per} = {need} "
                          f"tokens (the longest unit the data allows), got {budget}; set it to "
                          f"null for the automatic budget")


def check_recipe_engines(cfg) -> dict:
    """Every engine section of a recipe, checked (EngineConfig's rules and the budget);
    ref_engine / critic_engine written where the recipe has no such model are refused."""
    if not has_ref(cfg) and getattr(cfg, "ref_engine", None):
        raise ConfigError(f"ref_engine: recipe {cfg.recipe!r} has no reference model, got "
                          f"{cfg.ref_engine!r}")
    if has_ref(cfg) and cfg.engine.lora is not None and cfg.ref_engine:
        raise ConfigError(f"ref_engine: with engine.lora the reference is the policy with its "
                          f"adapters disabled (no second model); must be empty, got "
                          f"{cfg.ref_engine!r}")
    out = engines(cfg)
    for name, section in out.items():
        check_engine(section, name)
        check_budget(cfg, name, section)
    return out
