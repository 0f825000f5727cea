"""Frozen, validated configuration values.

Every class is an attrs frozen class; every validator raises ConfigError naming the field, the rule
and the value (``lr: must be > 0, got -1.0``). Serialisation lives in serde.py, not here.
"""

from __future__ import annotations

import json
import os

import attrs

from fsdpfn.errors import ConfigError
from fsdpfn.validators import (FLOAT32_MAX, boolean, fail, fits_float32, integer, is_number,
                               number, one_of, seed_int, str_tuple, temperature_rule, to_float,
                               to_opt_float, to_tuple)

__all__ = [
    "ParallelStrategy", "OptimizerConfig", "FSDPConfig", "MicroBatchSpec", "LoRAConfig",
    "EngineConfig", "PPOConfig", "CriticConfig", "AdvantageConfig", "SFTConfig", "RWConfig",
    "DPOConfig", "DTYPES",
]

DTYPES = ("float32", "bfloat16", "float16")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3", "abs")


# ---------------------------------------------------------------- parallelism and engine


@attrs.frozen
class ParallelStrategy:
    """Mesh shape: dp x cp x tp == world size. dp=-1 takes whatever is left."""

    dp: int = attrs.field(default=-1, validator=integer(1, allow=(-1,)))
    tp: int = attrs.field(default=1, validator=integer(1))
    cp: int = attrs.field(default=1, validator=integer(1))


@attrs.frozen
class OptimizerConfig:
    """AdamW with a warm-up plus constant / linear / cosine schedule and global-norm clipping.

    Weight decay applies to matrices only (norm weights and biases are skipped).
    ``total_steps`` is needed by the linear and cosine schedules.

    The rate at optimizer step s (0-based, counting warm-up): lr * (s + 1) / warmup_steps while
    s < warmup_steps; then lr * (m + (1 - m) * f(p)), m = min_lr_ratio, p = min((s -
    warmup_steps) / (total_steps - warmup_steps), 1), f(p) = 1 - p (linear) or (1 + cos(pi p))
    / 2 (cosine), 1 for constant (which ignores total_steps and min_lr_ratio): the floor is
    first used at step total_steps. Decay is decoupled and scaled by that rate (torch's AdamW),
    on every parameter of two or more dimensions, the embeddings and the head included (once
    when tied). Clipping scales the gradients by max_grad_norm / (norm + 1e-6) when the global
    norm over all parameters exceeds max_grad_norm; the step stats' ``grad_norm`` is the norm
    before clipping.
    """

    lr: float = attrs.field(default=1e-5, converter=to_float, validator=number(gt=0))
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), converter=to_tuple)
    eps: float = attrs.field(default=1e-8, converter=to_float, validator=number(gt=0))
    weight_decay: float = attrs.field(default=0.0, converter=to_float, validator=number(ge=0))
    schedule: str = attrs.field(default="constant", validator=one_of("constant", "linear", "cosine"))
    warmup_steps: int = attrs.field(default=0, validator=integer(0))
    total_steps: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))
    min_lr_ratio: float = attrs.field(default=0.0, converter=to_float, validator=number(ge=0, le=1))
    max_grad_norm: float | None = attrs.field(default=1.0, converter=to_opt_float,
                                              validator=number(gt=0, optional=True))

    @betas.validator
    def _check_betas(self, attribute, value):
        if (not isinstance(value, tuple) or len(value) != 2
                or not all(is_number(b) and 0 <= b < 1 for b in value)):
            fail(attribute.name, "must be two numbers in [0, 1)", value)

    def __attrs_post_init__(self):
        # AdamW's first step moves a parameter by lr / (1 - beta1) and decays it by
        # 1 - lr * weight_decay, both as float32 scalars: past float32's range torch refuses
        # the step halfway through the parameters, which would leave a partial update
        if self.lr / (1 - self.betas[0]) > FLOAT32_MAX:
            fail("lr", f"must keep AdamW's first step size lr / (1 - betas[0]) within float32's "
                       f"range (3.4e38; betas[0] = {self.betas[0]})", self.lr)
        if self.lr * self.weight_decay > FLOAT32_MAX:  # lr passed the rule above: a decay > 10
            fail("weight_decay", f"must keep lr * weight_decay within float32's range (3.4e38; "
                                 f"lr = {self.lr})", self.weight_decay)
        if self.schedule != "constant" and self.total_steps is None:
            raise ConfigError(f"total_steps: must be set for schedule {self.schedule!r}, got None")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ConfigError(f"warmup_steps: must be <= total_steps ({self.total_steps}), "
                              f"got {self.warmup_steps}")


@attrs.frozen
class FSDPConfig:
    """FSDP2 options. wrap_policy: decoder layer class names (None: the model's _no_split_modules).

    ``offload_params``: sharded parameters, gradients and the optimizer step live in (pinned)
    host memory; FSDP2 copies each unit's parameters to the device for its forward/backward.
    ``per_layer_optim_step``: the Adam state lives in pinned host memory and is streamed to the
    device one FSDP unit at a time for the step (fsdpfn.engine.optim_offload.PerLayerAdamW), with
    ``optim_step_prefetch_layers`` units loaded ahead (the device holds at most 1 + that many
    units' state); with ``offload_params`` too, parameters and gradients travel with it. Ignored
    by inference-only engines.
    """

    wrap_policy: tuple[str, ...] | None = attrs.field(default=None, converter=to_tuple,
                                                      validator=str_tuple)
    reshard_after_forward: bool = attrs.field(default=True, validator=boolean)
    offload_params: bool = attrs.field(default=False, validator=boolean)
    memory_efficient_load: bool = attrs.field(default=True, validator=boolean)
    per_layer_optim_step: bool = attrs.field(default=False, validator=boolean)
    optim_step_prefetch_layers: int = attrs.field(default=1, validator=integer(0))

    @wrap_policy.validator
    def _check_wrap_policy(self, attribute, value):
        if value is not None and not value:  # () would read as None: the model's default
            fail(attribute.name, "must name at least one module class (or be None: the model's "
                 "_no_split_modules)", value)

    def __attrs_post_init__(self):
        if self.optim_step_prefetch_layers != 1 and not self.per_layer_optim_step:
            raise ConfigError(f"optim_step_prefetch_layers: only used with "
                              f"per_layer_optim_step=True, got {self.optim_step_prefetch_layers} "
                              f"with per_layer_optim_step=False (set both, or leave the "
                              f"prefetch at its default 1)")


DEFAULT_MAX_TOKENS_PER_MB = 16384  # the automatic budget: the one the benchmarks measure


@attrs.frozen
class MicroBatchSpec:
    """Micro-batches by token budget (max_tokens_per_mb) and/or count (n_mbs, a minimum: never
    more micro-batches than units, a row or a group kept whole, so none is empty).

    ``max_tokens_per_mb=None`` (the default) is the automatic budget: micro-batches of at most
    DEFAULT_MAX_TOKENS_PER_MB = 16384 tokens (per context-parallel rank), the fast path the
    benchmarks measure, which bounds activation memory whatever the batch size; a row (or group
    kept whole) longer than that goes alone in its own micro-batch, never refused. An explicit
    budget is a hard limit: a longer row (or group) is a BatchError naming this field.

    ``algo`` balances tokens over the micro-batches (fsdpfn.batch.balanced_partition): ``"lpt"``
    (largest unit first into the lightest micro-batch) or ``"kk"`` (the better of LPT and
    Karmarkar-Karp); ``"ffd"`` is accepted as an alias of ``"lpt"`` (its former name).
    """

    max_tokens_per_mb: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))
    n_mbs: int = attrs.field(default=1, validator=integer(1))
    algo: str = attrs.field(default="lpt", validator=one_of("lpt", "kk", "ffd"))


def _names_conv(value):
    if value is None:  # null in YAML: the default, every linear of the decoder layers
        return ("all-linear",)
    return (value,) if isinstance(value, str) else to_tuple(value)


@attrs.frozen
class LoRAConfig:
    """Low-rank adapters (through peft) on the linears of the decoder layers.

    The adapter delta of a target weight is (alpha / rank) · B @ A (peft's scaling).
    ``target_modules``: leaf names of those linears (``q_proj``, ``down_proj``, ...) or
    ``["all-linear"]`` (the default, also what null means: every linear of the decoder
    layers; never lm_head).
    ``dropout`` is peft's dropout on the adapter input (kept even with
    ``EngineConfig.disable_dropout``, which concerns the base model).
    """

    rank: int = attrs.field(default=8, validator=integer(1))
    alpha: float = attrs.field(default=16.0, converter=to_float, validator=number(gt=0))
    dropout: float = attrs.field(default=0.0, converter=to_float, validator=number(ge=0, lt=1))
    target_modules: tuple[str, ...] = attrs.field(default=("all-linear",), converter=_names_conv,
                                                  validator=str_tuple)

    @target_modules.validator
    def _check_targets(self, attribute, value):
        if value is not None and not value:
            fail(attribute.name, "must name at least one module (or be ['all-linear'])", value)
        if value is not None and len(value) > 1 and all(len(v) == 1 for v in value):
            fail(attribute.name, "must be a list of module names, not one name's characters "
                  "(one name alone is that name: q_proj or [q_proj, v_proj])", list(value))
        if value is not None and "all-linear" in value and len(value) > 1:
            fail(attribute.name, "'all-linear' must stand alone", list(value))


def _model_config_conv(value):
    to_dict = getattr(value, "to_dict", None)  # a transformers PretrainedConfig
    if callable(to_dict):
        value = to_dict()
    if isinstance(value, dict):
        try:  # plain JSON data (string keys), so that YAML/JSON round trips are exact
            return json.loads(json.dumps(value))
        except (TypeError, ValueError):
            return value
    return value


def _path_conv(value):
    """A pathlib.Path (any os.PathLike) is kept as its string; anything else is left to the
    validator."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@attrs.frozen
class EngineConfig:
    """One model's engine: where the weights come from, precision, micro-batching, optimizer.

    Exactly one of ``model_path`` (a local HF directory) and ``model_config`` (a transformers
    config, as a dict with ``model_type`` or a PretrainedConfig, built with random init) is given.
    ``optimizer=None`` gives an inference-only state.
    """

    model_path: str | None = attrs.field(default=None, converter=_path_conv)
    model_config: dict | None = attrs.field(default=None, converter=_model_config_conv)
    is_critic: bool = attrs.field(default=False, validator=boolean)
    dtype: str = attrs.field(default="bfloat16", validator=one_of("bfloat16", "float32"))
    grad_reduce_dtype: str = attrs.field(default="float32", validator=one_of(*DTYPES))
    optimizer_dtype: str = attrs.field(default="float32", validator=one_of("float32", "bfloat16"))
    gradient_checkpointing: bool = attrs.field(default=False, validator=boolean)
    disable_dropout: bool = attrs.field(default=True, validator=boolean)
    logprobs_chunk_size: int = attrs.field(default=1024, validator=integer(1))
    mb_spec: MicroBatchSpec = attrs.field(factory=MicroBatchSpec)
    optimizer: OptimizerConfig | None = attrs.field(factory=OptimizerConfig)
    fsdp: FSDPConfig = attrs.field(factory=FSDPConfig)
    lora: LoRAConfig | None = attrs.field(default=None)
    seed: int = attrs.field(default=1, validator=seed_int)
    # attention over packed sequences: "auto" (flash varlen on CUDA in bf16/fp16, else masked
    # SDPA), "varlen" (CUDA only), "sdpa" (the masked path everywhere)
    attn_impl: str = attrs.field(default="auto", validator=one_of("auto", "varlen", "sdpa"))
    # Liger-Kernel's fused RMSNorm and SwiGLU on CUDA when liger_kernel is installed (a no-op on
    # CPU or without it); False keeps HF's eager modules
    fused_kernels: bool = attrs.field(default=True, validator=boolean)
    # regional compilation: torch.compile of every decoder block's forward (inductor fuses the
    # norms, rotary, SwiGLU and residual adds; the attention call stays outside the graph), in
    # place of the Liger modules; compiled once per block class on the first steps
    compile: bool = attrs.field(default=False, validator=boolean)
    # the log-prob head: "chunked" (fsdpfn.ops.chunked_logprobs, float32 logits, any device,
    # entropy, tp) or "liger" (Liger-Kernel's fused linear cross-entropy: CUDA, tp=1; a call that
    # asks for entropy takes the chunked head)
    logprobs_impl: str = attrs.field(default="chunked", validator=one_of("chunked", "liger"))
    # the model guard (fsdpfn.engine.families): "unverified" checks, when the model is built, that the
    # engine's packed forward equals the model's own eager forward for a family outside the
    # verified list (a small random instance of the same architecture, float32, two short rows),
    # refusing the model with the gap on disagreement; "always" checks verified families too;
    # "never" skips the check. The check runs at tp=1: under tp > 1 a family outside the
    # verified list is refused, unless "never"
    verify_model: str = attrs.field(default="unverified",
                                    validator=one_of("unverified", "always", "never"))
    # per-call stage times, peak memory, tokens/s and MFU in the stats (fsdpfn.engine.timing): CUDA
    # events read once at the end of a call, no host synchronisation per micro-batch
    timing: bool = attrs.field(default=True, validator=boolean)
    # the per-GPU dense matmul rate (TFLOP/s) MFU is quoted against; None: measured once per
    # process by a GEMM in the compute dtype on CUDA (on CPU, no MFU unless given)
    peak_tflops: float | None = attrs.field(default=None, converter=to_opt_float,
                                            validator=number(gt=0, optional=True))

    @model_path.validator
    def _check_path(self, attribute, value):
        if value is not None and (not isinstance(value, str) or not value):
            fail(attribute.name, "must be a non-empty path string or None", value)

    @model_config.validator
    def _check_model_config(self, attribute, value):
        if value is not None and (not isinstance(value, dict) or "model_type" not in value):
            fail(attribute.name, "must be a transformers config (a dict with 'model_type')", value)

    def __attrs_post_init__(self):
        if (self.model_path is None) == (self.model_config is None):
            raise ConfigError("model_path: exactly one of model_path and model_config must be set, "
                              f"got model_path={self.model_path!r} and "
                              f"model_config={'set' if self.model_config else None}")
        for name, cls in (("mb_spec", MicroBatchSpec), ("fsdp", FSDPConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}: must be a {cls.__name__}, got {getattr(self, name)!r}")
        for name, cls in (("optimizer", OptimizerConfig), ("lora", LoRAConfig)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise ConfigError(f"{name}: must be a {cls.__name__} or None, got {value!r}")
        if self.lora is not None and self.is_critic:
            raise ConfigError("lora: adapters on a critic are not supported (its value head "
                              "would need full training), must be None with is_critic=True, got "
                              f"{self.lora!r}")


# ---------------------------------------------------------------- algorithms


@attrs.frozen
class PPOConfig:
    """PPO / GRPO actor update.

    ``clip_high=None`` means symmetric clipping. ``kl_coef>0`` adds coef·KL(π‖π_ref) to the loss
    (needs ``ref_logp``). ``use_behav_logp``: decoupled PPO weights from ``behav_logp`` when present.

    Trainer-rollout mismatch (``fsdpfn.ops.behav_weights``; each needs ``behav_logp`` in the
    batch): ``behav_cap`` truncates token weights at the cap; ``behav_correction`` 'tis' truncates
    to [behav_low, behav_high] (behav_low None: no lower bound), 'mis' zeroes tokens (or whole
    rows) whose weight leaves it (behav_low None: 1/behav_high); behav_high defaults to 2.0.
    ``behav_level``: 'token', 'sequence' (product over the row) or 'geometric' (geometric mean).
    ``policy_loss='cispo'``: CISPO's clipped, detached ratio times log π; its bounds are
    [1 − cispo_clip_low (None: none), 1 + cispo_clip_high (None: the PPO upper clip)].
    ``check_on_policy``: warn when the first minibatch's mean |logp − old_logp| exceeds
    ``on_policy_tol`` (on-policy data must have ratio 1 before the first update).
    ``old_logp_from``: where the ratio's denominator (the proximal policy) comes from. 'batch'
    (default): the batch's ``old_logp`` (required). 'forward': the training forward itself,
    detached: with one minibatch the update starts at the weights old_logp would be computed
    with, so the ratio is 1 by construction and the separate ``forward_logp`` pass is saved
    (needs n_minibatches=1). 'auto': the batch's ``old_logp`` when present, else the training
    forward when n_minibatches=1 (else ``old_logp`` is required). 'behav': the batch's ``behav_logp`` (no
    proximal pass at any n_minibatches; an approximation when the sampler's weights are older
    than the trainer's: the ratio is then anchored at the sampling policy, and the stat
    ``on_policy_gap`` with check_on_policy measures how far that is from the proximal policy).
    """

    clip_low: float = attrs.field(default=0.2, converter=to_float, validator=number(gt=0, lt=1))
    clip_high: float | None = attrs.field(default=None, converter=to_opt_float,
                                          validator=number(gt=0, optional=True))
    dual_clip: float | None = attrs.field(default=None, converter=to_opt_float,
                                          validator=number(gt=1, optional=True))
    agg: str = attrs.field(default="token-mean", validator=one_of(*AGG_MODES))
    ratio_level: str = attrs.field(default="token", validator=one_of("token", "sequence"))
    n_minibatches: int = attrs.field(default=1, validator=integer(1))
    shuffle: bool = attrs.field(default=False, validator=boolean)
    entropy_coef: float = attrs.field(default=0.0, converter=to_float, validator=number(ge=0))
    kl_coef: float = attrs.field(default=0.0, converter=to_float, validator=number(ge=0))
    kl_kind: str = attrs.field(default="k3", validator=one_of(*KL_KINDS))
    use_behav_logp: bool = attrs.field(default=True, validator=boolean)
    behav_cap: float | None = attrs.field(default=None, converter=to_opt_float,
                                          validator=number(gt=0, optional=True))
    temperature: float = attrs.field(default=1.0, converter=to_float, validator=temperature_rule)
    seed: int = attrs.field(default=0, validator=seed_int)
    # trainer-rollout mismatch (fsdpfn.ops.correction)
    behav_correction: str | None = attrs.field(default=None, validator=one_of(None, "tis", "mis"))
    behav_level: str = attrs.field(default="token",
                                   validator=one_of("token", "sequence", "geometric"))
    behav_low: float | None = attrs.field(default=None, converter=to_opt_float,
                                          validator=number(ge=0, optional=True))
    behav_high: float | None = attrs.field(default=None, converter=to_opt_float,
                                           validator=number(gt=0, optional=True))
    policy_loss: str = attrs.field(default="ppo", validator=one_of("ppo", "cispo"))
    cispo_clip_low: float | None = attrs.field(default=None, converter=to_opt_float,
                                               validator=number(gt=0, le=1, optional=True))
    cispo_clip_high: float | None = attrs.field(default=None, converter=to_opt_float,
                                                validator=number(gt=0, optional=True))
    check_on_policy: bool = attrs.field(default=False, validator=boolean)
    on_policy_tol: float = attrs.field(default=1e-3, converter=to_float, validator=number(gt=0))
    old_logp_from: str = attrs.field(default="batch",
                                  validator=one_of("auto", "batch", "forward", "behav"))

    def __attrs_post_init__(self):
        _check_ppo_behav(self)
        _check_ppo_cispo(self)
        if self.old_logp_from == "forward" and self.n_minibatches != 1:
            raise ConfigError(f"old_logp_from: 'forward' needs n_minibatches=1 (after the first "
                              f"optimizer step the training forward is no longer the policy that "
                              f"old_logp stands for), got n_minibatches={self.n_minibatches}")

    @property
    def behav_bounds(self) -> tuple[float | None, float | None]:
        """(low, high) handed to the correction: behav_high defaults to 2.0."""
        if self.behav_correction is None:
            return None, None
        return self.behav_low, 2.0 if self.behav_high is None else self.behav_high

    @property
    def cispo_bounds(self) -> tuple[float, float]:
        """(clip_low, clip_high) of CISPO's weight: no lower bound unless cispo_clip_low; the
        upper one cispo_clip_high, else the PPO upper clip (clip_high or clip_low)."""
        hi = self.cispo_clip_high
        if hi is None:
            hi = self.clip_low if self.clip_high is None else self.clip_high
        return (1.0 if self.cispo_clip_low is None else self.cispo_clip_low), hi


def _check_ppo_behav(c: PPOConfig) -> None:
    if c.behav_correction is None:
        for name in ("behav_low", "behav_high"):
            if getattr(c, name) is not None:
                raise ConfigError(f"{name}: needs behav_correction 'tis' or 'mis', got "
                                  f"{getattr(c, name)!r} with behav_correction=None")
        if c.behav_level != "token":
            raise ConfigError(f"behav_level: needs behav_correction 'tis' or 'mis' (an untruncated "
                              f"sequence weight has unbounded variance), got {c.behav_level!r}")
        if c.behav_cap is not None and not c.use_behav_logp:
            raise ConfigError(f"use_behav_logp: must be True with behav_cap={c.behav_cap!r} (the "
                              f"cap truncates the behav_logp weights it turns off), got False")
        return
    if c.behav_cap is not None:
        raise ConfigError(f"behav_cap: must be None with behav_correction={c.behav_correction!r} "
                          f"(behav_cap is token 'tis' at the cap; use behav_high), got {c.behav_cap!r}")
    if not c.use_behav_logp:
        raise ConfigError(f"use_behav_logp: must be True with behav_correction="
                          f"{c.behav_correction!r}, got False")
    low, high = c.behav_bounds
    if low is not None and not low < high:
        raise ConfigError(f"behav_low: must be < behav_high ({high}), got {low!r}")


def _check_ppo_cispo(c: PPOConfig) -> None:
    if c.policy_loss == "cispo":
        if c.dual_clip is not None:
            raise ConfigError(f"dual_clip: must be None with policy_loss='cispo', got {c.dual_clip!r}")
        return
    for name in ("cispo_clip_low", "cispo_clip_high"):
        if getattr(c, name) is not None:
            raise ConfigError(f"{name}: needs policy_loss='cispo', got {getattr(c, name)!r} with "
                              f"policy_loss={c.policy_loss!r}")


@attrs.frozen
class CriticConfig:
    """Critic (value model) update with value clipping."""

    value_clip: float | None = attrs.field(default=0.5, converter=to_opt_float,
                                           validator=number(gt=0, optional=True))
    agg: str = attrs.field(default="token-mean", validator=one_of(*AGG_MODES))
    n_minibatches: int = attrs.field(default=1, validator=integer(1))
    shuffle: bool = attrs.field(default=False, validator=boolean)
    seed: int = attrs.field(default=0, validator=seed_int)


@attrs.frozen
class AdvantageConfig:
    """Advantage estimation.

    estimator: ``grpo`` (group mean and std), ``drgrpo`` (group mean, no std), ``rloo``
    (leave-one-out mean), ``reinforce++`` (reward minus KL per token, whitened over the batch),
    ``gae`` (needs ``values``). The grouped estimators (grpo, drgrpo, rloo) read the outcome
    ``rewards`` only (a batch's dense ``token_rewards`` are not added: compute_advantages
    warns); reinforce++ and gae add ``token_rewards`` to the outcome at the last loss token.
    ``kl_coef>0`` puts coef·KL(old_logp‖ref_logp) into the token rewards (the policy that
    sampled: the batch's ``old_logp``, else its ``logp``); for a grouped estimator that is each
    token's advantage minus the penalty's undiscounted sum from that token on. Rewards are
    first scaled and shifted (r·reward_scale + reward_bias), then clipped to ±reward_clip.
    ``group_size``: the samples per prompt of the grouped estimators; its default 1 makes each
    row its own group, where every grpo/drgrpo advantage is 0 (compute_advantages warns).
    ``returns`` is the signal before whitening: GAE's advantages + values, reinforce++'s
    returns-to-go, a grouped estimator's advantages. ``whiten``: whiten the advantages over the
    batch's loss tokens (dp-global with a mesh) after the estimator; reinforce++ is whitened
    whatever its value, as the estimator is defined.
    """

    estimator: str = attrs.field(default="grpo",
                                 validator=one_of("grpo", "drgrpo", "rloo", "reinforce++", "gae"))
    group_size: int = attrs.field(default=1, validator=integer(1))
    gamma: float = attrs.field(default=1.0, converter=to_float, validator=number(ge=0, le=1))
    lam: float = attrs.field(default=1.0, converter=to_float, validator=number(ge=0, le=1))
    kl_coef: float = attrs.field(default=0.0, converter=to_float,
                                 validator=[number(ge=0), fits_float32])
    kl_kind: str = attrs.field(default="k1", validator=one_of(*KL_KINDS))
    reward_scale: float = attrs.field(default=1.0, converter=to_float,
                                      validator=[number(), fits_float32])
    reward_bias: float = attrs.field(default=0.0, converter=to_float,
                                     validator=[number(), fits_float32])
    reward_clip: float | None = attrs.field(default=None, converter=to_opt_float,
                                            validator=number(gt=0, optional=True))
    whiten: bool = attrs.field(default=False, validator=boolean)
    eps: float = attrs.field(default=1e-6, converter=to_float, validator=number(gt=0))

    def __attrs_post_init__(self):
        if self.estimator == "rloo" and self.group_size < 2:
            raise ConfigError(f"group_size: must be >= 2 for estimator 'rloo', got {self.group_size}")


@attrs.frozen
class SFTConfig:
    """Supervised fine-tuning: -mean log-likelihood of loss_mask tokens."""

    agg: str = attrs.field(default="token-mean", validator=one_of(*AGG_MODES))


@attrs.frozen
class RWConfig:
    """Reward model: Bradley-Terry on last-token scores of pairs (row 2i chosen, 2i+1 rejected)."""

    margin: float = attrs.field(default=0.0, converter=to_float, validator=number())


@attrs.frozen
class DPOConfig:
    """DPO on sequence log-prob sums; needs ``ref_logp``. kind: ``sigmoid`` or ``ipo``."""

    beta: float = attrs.field(default=0.1, converter=to_float, validator=number(gt=0))
    kind: str = attrs.field(default="sigmoid", validator=one_of("sigmoid", "ipo"))
