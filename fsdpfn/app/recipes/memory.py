"""What a run's state costs in bytes, against the room it has: one trainer GPU's memory, the
host's memory and the run_dir's disk; a run that does not fit is refused, naming the options
that would make it fit.

    check_memory(cfg, shape, n_gpus=..., capacity=..., shared=...)  # one trainer GPU
    check_host_memory(cfg, shape, available=...)                    # state kept on the host
    check_disk(cfg, shape)                                          # one checkpoint
    check_cpu_memory(cfg, shape, placement, available=...)  # a CPU run (cpu_memory.py)

- one trainer GPU: weights + gradients + optimizer state + activations of every model the
  recipe builds, plus the rollout server's weights and decode cache when it shares the GPU;
- the host: where an option keeps state in host memory (the per-layer step's Adam moments,
  offloaded parameters), that state summed over the host's trainer ranks;
- the disk: one checkpoint (every trained model's weights and Adam state) against the free
  space where run_dir will be.

The estimate (``estimate_memory``) is a pure function of the model's shape and the engine
options, written out below. The shape (fsdpfn.app.recipes.model_shape.ModelShape) is read from
the model's config.json, with the parameter counts of its safetensors headers where they read
as its layers (exact for any family's layer), and what a layer keeps for the backward follows
its family, softcapped attention's scores included (tests/unit/test_memory_activations.py).
The estimate leaves out what is small next to these terms (the formulas' biases, norms' fp32
copies, the CUDA context), and the refusal keeps ``HEADROOM`` of the device for them.
fsdpfn.app.recipes.preflight reads the device's and the host's memory and calls these checks.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from fsdpfn.config import DEFAULT_MAX_TOKENS_PER_MB
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.engine import engines, longest_row
from fsdpfn.app.recipes.model_shape import ModelShape

__all__ = ["ModelShape", "estimate_memory", "run_estimate", "server_cache", "server_bytes",
           "check_memory", "host_bytes", "check_host_memory", "checkpoint_bytes", "check_disk",
           "HEADROOM", "GiB"]

GiB = 1024 ** 3
HEADROOM = 0.9          # the share of a GPU's memory the estimate may fill
BYTES = {"float32": 4, "bfloat16": 2}


# ---------------------------------------------------------------- the memory estimate


@attrs.frozen
class _Sizes:
    """What one model of the run costs per parameter, from its engine section: ``master`` (the
    weights and gradients, optimizer_dtype), ``compute`` (a frozen LoRA base, the compute
    dtype), ``adam`` (two moments, plus the Kahan compensation with a bf16 state), and its
    parameter counts: ``trained`` (the adapters with LoRA) and ``weights`` bytes (a LoRA base
    in the compute dtype plus the adapters in optimizer_dtype)."""

    master: int
    compute: int
    adam: int
    trained: int
    weights: int


def _sizes(shape: ModelShape, section) -> _Sizes:
    m = BYTES[section.optimizer_dtype]
    c = BYTES[section.dtype if section.dtype != "auto" else "bfloat16"]
    adam = 2 * m + (2 if section.optimizer_dtype == "bfloat16" else 0)
    if section.lora is None:
        return _Sizes(m, c, adam, shape.params, m * shape.params)
    trained = shape.lora_params(section.lora)
    return _Sizes(m, c, adam, trained, c * shape.params + m * trained)


def _states(shape: ModelShape, section, n: int, *, train: bool) -> dict[str, float]:
    """Per-GPU bytes of one model's sharded states (FSDP over n GPUs). Master weights and
    gradients are in optimizer_dtype; Adam keeps two moments (plus a Kahan compensation buffer
    in bf16); per_layer_optim_step moves Adam's state to the host (the device holds 1 +
    optim_step_prefetch_layers layers of it); offload_params moves everything to the host; a
    LoRA base is frozen in the compute dtype, only the adapters train."""
    z = _sizes(shape, section)
    fsdp = section.fsdp
    if fsdp.offload_params:
        return {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0}
    if not train:
        return {"weights": z.master * shape.params / n, "gradients": 0.0, "optimizer": 0.0}
    optimizer = z.adam * z.trained / n
    if fsdp.per_layer_optim_step:
        share = min(1.0, (1 + fsdp.optim_step_prefetch_layers) / shape.layers)
        optimizer = z.adam * z.trained * share / n
    return {"weights": z.weights / n, "gradients": z.master * z.trained / n,
            "optimizer": optimizer}


def estimate_memory(shape: ModelShape, section, *, n_gpus: int, tokens: int,
                    train: bool = True, row: int | None = None) -> dict[str, float]:
    """Bytes on one GPU for one model: its sharded states (_states), the layers FSDP gathers
    (two layers and the root in the compute dtype, one layer's float32 gradient before its
    reduce-scatter) and the activations of a micro-batch of ``tokens`` tokens: every layer's
    saved tensors, or with gradient_checkpointing each layer's input plus one layer's saved
    tensors, and the log-prob head's float32 logits (three copies of a chunk of
    logprobs_chunk_size tokens x vocab). ``train=False``: a forward without autograd (one
    layer's tensors at a time). ``row``: the longest row of the micro-batch (None: one row of
    ``tokens``), for the attention that keeps its scores (ModelShape.act_bytes_layer)."""
    c = _sizes(shape, section).compute
    out = _states(shape, section, n_gpus, train=train)
    gathered = c * (2 * shape.layer_params + shape.root_params)
    out["gathered"] = gathered + (4 * shape.layer_params if train else 0)
    per_layer = shape.act_bytes_layer(tokens, tokens if row is None else row, c)
    if not train:
        layers = per_layer
    elif section.gradient_checkpointing:
        layers = shape.layers * c * shape.hidden * tokens + per_layer
    else:
        layers = shape.layers * per_layer
    chunk = min(tokens, section.logprobs_chunk_size)
    out["activations"] = layers + 3 * 4 * chunk * shape.vocab
    out["total"] = sum(out.values())
    return out


def _tokens(cfg, section, n_gpus: int) -> int:
    """Tokens of the largest micro-batch on one GPU: the budget (automatic: the default), at
    most what one optimizer minibatch holds per data-parallel rank, at least the longest row
    (which goes alone), per cp rank."""
    row = longest_row(cfg)[0]
    rows = {"grpo": lambda: cfg.prompts_per_step * cfg.advantage.group_size
            // cfg.ppo.n_minibatches,
            "ppo": lambda: cfg.prompts_per_step // cfg.ppo.n_minibatches,
            "sft": lambda: cfg.batch_size,
            "rw": lambda: 2 * cfg.pairs_per_step, "dpo": lambda: 2 * cfg.pairs_per_step}
    budget = section.mb_spec.max_tokens_per_mb or DEFAULT_MAX_TOKENS_PER_MB
    cp = cfg.parallel.cp
    dp = max(1, n_gpus // (cp * cfg.parallel.tp))
    per_dp_rank = -(-max(1, rows[cfg.recipe]()) // dp) * row
    return -(-max(row, min(budget * cp, per_dp_rank)) // cp)


def server_cache(cfg) -> tuple[int, int]:
    """(slots, positions) of each server's decode cache, as its command line sets them: the
    launcher's flags (fsdpfn.app.servers.decode_cache_args: a slot for each of the server's
    share of a step's answers, positions for the longest row the data allows), then
    rollout.server_args, whose flags win."""
    from fsdpfn.app.recipes.rollout_config import server_namespace
    from fsdpfn.app.servers import decode_cache_args

    ns = server_namespace([*decode_cache_args(cfg), *cfg.rollout.server_args])
    return ns.decode_rows, ns.decode_max_len


def server_bytes(cfg, shape: ModelShape, dtype: str = "bfloat16") -> dict[str, float]:
    """One server's bytes on its GPU: the weights in ``dtype`` (the trainer's compute dtype,
    which the launcher passes as --dtype) and the decode cache (k and v of every layer for
    each slot's positions, in that dtype, or one byte each with --kv-cache-dtype fp8_e4m3)."""
    from fsdpfn.app.recipes.rollout_config import server_namespace

    size = BYTES.get(dtype, 2)
    slots, positions = server_cache(cfg)
    fp8 = server_namespace(list(cfg.rollout.server_args)).kv_cache_dtype == "fp8_e4m3"
    per_slot = positions * shape.layers * 2 * shape.kv_heads * shape.head_dim * (1 if fp8
                                                                                  else size)
    return {"weights": float(size * shape.params), "decode cache": float(slots * per_slot)}


def run_estimate(cfg, shape: ModelShape, *, n_gpus: int, shared: bool) -> dict[str, float]:
    """Per-GPU bytes of the whole run: every model's states, the largest gathered layers and
    activations among them (models run one after another), and the server when it shares."""
    states, peak = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0}, 0.0
    for name, section in engines(cfg).items():
        est = estimate_memory(shape, section, n_gpus=n_gpus, tokens=_tokens(cfg, section, n_gpus),
                              train=name != "ref_engine", row=longest_row(cfg)[0])
        for k in states:
            states[k] += est[k]
        peak = max(peak, est["gathered"] + est["activations"])
    out = {**states, "gathered + activations": peak}
    if shared:
        out["rollout server"] = sum(server_bytes(cfg, shape).values())
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------- host memory


def host_bytes(cfg, shape: ModelShape) -> dict[str, float]:
    """Bytes the run keeps in the host's memory, over all its trainer ranks (one host): the
    per-layer step's Adam state (pinned; the device holds a few layers of it at a time) and
    offload_params' weights, gradients and Adam state (pinned; the optimizer steps on the
    host). What each rank reads or stages in passing (a safetensors tensor, a push bucket) is
    small next to these and left out."""
    out = {"optimizer state": 0.0, "offloaded weights and gradients": 0.0}
    for name, section in engines(cfg).items():
        train = name != "ref_engine"
        z = _sizes(shape, section)
        if section.fsdp.offload_params:
            out["offloaded weights and gradients"] += z.weights + (
                z.master * z.trained if train else 0)
            out["optimizer state"] += z.adam * z.trained if train else 0
        elif train and section.fsdp.per_layer_optim_step:
            out["optimizer state"] += z.adam * z.trained
    return out


def check_host_memory(cfg, shape: ModelShape, *, available: float | None) -> str | None:
    """host_bytes against the host's available memory: None when the run keeps nothing there
    (or the host's memory is unknown), a note when it fits, else a ConfigError naming what
    would make it fit."""
    est = host_bytes(cfg, shape)
    total = sum(est.values())
    if not total or available is None:
        return None
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in est.items() if v)
    line = (f"host memory estimate: {total / GiB:.1f} GiB of {available / GiB:.1f} GiB "
            f"available ({parts})")
    if total <= HEADROOM * available:
        return line
    fixes = [name for name, fix in _smaller_state(cfg)
             if sum(host_bytes(fix, shape).values()) <= HEADROOM * available]
    hint = " or ".join(fixes + ["a host with more memory"])
    raise ConfigError(f"engine: the run's host-side state does not fit this host's memory, "
                      f"{line}, more than {HEADROOM:.0%} of it; it would fit with {hint}")


# ---------------------------------------------------------------- a step's rows on the host

# bytes a token of a step's rows takes on the host, at least: its id (int64), masks, and the
# float32 columns the step adds (log-probs, advantages, returns, weights); the rollout's
# answers as Python lists take more while they are read
BATCH_BYTES_PER_TOKEN = 64


def _row_counts(cfg) -> list[tuple[str, str, int]]:
    """(key, what was set, rows) of each batch the run holds on the host at once."""
    def grpo():
        p, g = cfg.prompts_per_step, cfg.advantage.group_size
        return ("prompts_per_step", f"prompts_per_step x advantage.group_size = {p} x {g}",
                p * g)

    step = {"grpo": grpo,
            "ppo": lambda: ("prompts_per_step", str(cfg.prompts_per_step),
                            cfg.prompts_per_step),
            "sft": lambda: ("batch_size", str(cfg.batch_size), cfg.batch_size),
            "rw": lambda: ("pairs_per_step", f"{cfg.pairs_per_step} pairs",
                           2 * cfg.pairs_per_step),
            "dpo": lambda: ("pairs_per_step", f"{cfg.pairs_per_step} pairs",
                            2 * cfg.pairs_per_step)}
    out = [step[cfg.recipe]()]
    if getattr(cfg, "warmup", None) is not None and cfg.warmup.steps != 0:
        out.append(("warmup.batch_size", str(cfg.warmup.batch_size), cfg.warmup.batch_size))
    if getattr(cfg, "eval", None) is not None and cfg.eval.every:
        out.append(("eval.n_prompts", str(cfg.eval.n_prompts), cfg.eval.n_prompts))
    return out


def check_batch_rows(cfg, *, available: float | None) -> None:
    """Each batch a step holds on the host (its rows at the longest row the data allows)
    against the host's available memory: a count with a few zeros too many is refused by name
    before it hangs a rank drawing rows or fills the host."""
    if available is None:
        return
    row, how = longest_row(cfg)
    for key, shown, rows in _row_counts(cfg):
        need = rows * row * BATCH_BYTES_PER_TOKEN
        if need > HEADROOM * available:
            raise ConfigError(f"{key}: one batch must fit the host's memory: {rows:,} rows of "
                              f"up to {row} tokens ({how}) take about {need / GiB:,.1f} GiB, "
                              f"more than {HEADROOM:.0%} of this host's {available / GiB:.1f} "
                              f"GiB available, got {shown}")


# ---------------------------------------------------------------- disk


def checkpoint_bytes(cfg, shape: ModelShape) -> float:
    """Bytes of one checkpoint of the run: every trained model's weights in its optimizer_dtype
    (a LoRA state: its adapters alone) and its Adam state (two moments, plus the Kahan
    compensation in bf16). The reference model is not saved."""
    total = 0.0
    for name, section in engines(cfg).items():
        if name == "ref_engine":
            continue
        z = _sizes(shape, section)
        total += (z.master + z.adam) * z.trained
    return total


def _free_bytes(path: Path) -> float:
    """Free bytes of the filesystem that holds ``path`` (its nearest existing parent)."""
    import shutil

    path = path.resolve()
    while not path.exists():
        path = path.parent
    return float(shutil.disk_usage(path).free)


def check_disk(cfg, shape: ModelShape) -> str:
    """One checkpoint against the run_dir's free space: a note when it fits (and a warning when
    ``keep_last`` + 1 of them would not: the newest is written before the oldest goes), else a
    ConfigError naming what would make it fit."""
    size, free = checkpoint_bytes(cfg, shape), _free_bytes(Path(cfg.run_dir))
    keep = cfg.checkpoint.keep_last + 1
    line = (f"checkpoint estimate: {size / GiB:.1f} GiB each, {free / GiB:.1f} GiB free at "
            f"{cfg.run_dir}")
    if size <= free:
        if keep * size > free:
            line += (f" (not enough for checkpoint.keep_last={cfg.checkpoint.keep_last} plus "
                     f"the one being written: old ones must go before the disk fills)")
        return line
    fixes = [name for name, fix in _smaller_state(cfg) if checkpoint_bytes(fix, shape) <= free]
    hint = " or ".join(fixes + ["a run_dir on a disk with more room"])
    raise ConfigError(f"checkpoint: one checkpoint of this run does not fit its disk, {line}; "
                      f"it would fit with {hint}")


# ---------------------------------------------------------------- the refusal


def _policy(cfg, **changes):
    """``cfg`` with a fix of the policy's engine (the critic and the reference inherit it)."""
    section = cfg.engine
    if "fsdp" in changes:
        changes["fsdp"] = attrs.evolve(section.fsdp, **changes["fsdp"])
    return attrs.evolve(cfg, engine=attrs.evolve(section, **changes))


def _ref_offload(cfg):
    if "ref_engine" not in engines(cfg):
        return None
    over = {**cfg.ref_engine, "fsdp": {**cfg.ref_engine.get("fsdp", {}), "offload_params": True}}
    return attrs.evolve(cfg, ref_engine=over)


def _lora(cfg):
    """With LoRA the reference is the policy without its adapters, so a recipe's ref_engine
    stays empty (sft and rw have none)."""
    from fsdpfn.config import LoRAConfig

    changes = {"engine": attrs.evolve(cfg.engine, lora=LoRAConfig(rank=16))}
    if "ref_engine" in attrs.fields_dict(type(cfg)):
        changes["ref_engine"] = {}
    return attrs.evolve(cfg, **changes)


def _applied(fix, cfg):
    """``fix(cfg)``, or None where the recipe refuses that option (rw's reward model trains in
    full: no LoRA), so that a refusal offers only the options the recipe takes."""
    try:
        return fix(cfg)
    except ConfigError:
        return None


def _smaller_state(cfg) -> tuple:
    """(option, cfg with it) of the options that shrink the state a run saves and keeps on the
    host and that the recipe takes: the bf16 state, LoRA (what check_disk and
    check_host_memory offer)."""
    options = (("engine.optimizer_dtype=bfloat16",
                lambda c: _policy(c, optimizer_dtype="bfloat16")),
               ("engine.lora.rank=16", _lora))
    return tuple((name, fixed) for name, fix in options
                 if (fixed := _applied(fix, cfg)) is not None)


# what would make a run fit, in the order a user would try them
FIXES = {
    "engine.fsdp.per_layer_optim_step=true": lambda c: _policy(
        c, fsdp={"per_layer_optim_step": True}),
    "engine.optimizer_dtype=bfloat16": lambda c: _policy(c, optimizer_dtype="bfloat16"),
    "engine.gradient_checkpointing=true": lambda c: _policy(c, gradient_checkpointing=True),
    "ref_engine.fsdp.offload_params=true": _ref_offload,
    "engine.lora.rank=16": _lora,
}


def _fits(cfg, shape, n_gpus, capacity, shared) -> bool:
    if cfg is None:
        return False
    return run_estimate(cfg, shape, n_gpus=n_gpus, shared=shared)["total"] <= HEADROOM * capacity


def _all_fixes(cfg):
    for name in list(FIXES)[:4]:
        cfg = _applied(FIXES[name], cfg) or cfg
    return cfg


def _smaller_budget(cfg, shape, n_gpus, capacity, shared) -> int | None:
    """The largest micro-batch budget that makes the run fit alone: the policy's budget (or
    the automatic one) halved until it fits, in multiples of 1,024 tokens, never below the
    longest row (which goes alone in its micro-batch whatever the budget); None when none
    does. Fewer tokens a micro-batch cost a little speed, nothing of the result."""
    budget = cfg.engine.mb_spec.max_tokens_per_mb or DEFAULT_MAX_TOKENS_PER_MB
    row = longest_row(cfg)[0]
    while budget // 2 >= max(row, 1024):
        budget = budget // 2 // 1024 * 1024
        spec = attrs.evolve(cfg.engine.mb_spec, max_tokens_per_mb=max(budget, row))
        if _fits(_policy(cfg, mb_spec=spec), shape, n_gpus, capacity, shared):
            return max(budget, row)
    return None


def check_memory(cfg, shape: ModelShape, *, n_gpus: int, capacity: float,
                 shared: bool = False, busy: str = "") -> str:
    """The estimate against ``capacity`` bytes per GPU: a note when it fits, else a ConfigError
    naming the options (each alone, else the first four together, or more GPUs) that would.
    ``busy``: what other processes hold on the run's GPUs (capacity is then what is free)."""
    est = run_estimate(cfg, shape, n_gpus=n_gpus, shared=shared)
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in est.items() if k != "total" and v)
    line = (f"memory estimate per GPU: {est['total'] / GiB:.1f} GiB of {capacity / GiB:.1f} "
            f"GiB{' free' if busy else ''} ({parts}{'; ' + busy if busy else ''})")
    if est["total"] <= HEADROOM * capacity:
        return line
    fixes = [name for name, fix in FIXES.items()
             if _fits(_applied(fix, cfg), shape, n_gpus, capacity, shared)]
    budget = _smaller_budget(cfg, shape, n_gpus, capacity, shared)
    if budget is not None:
        fixes.append(f"engine.mb_spec.max_tokens_per_mb={budget}")
    if not fixes and _fits(_all_fixes(cfg), shape, n_gpus, capacity, shared):
        fixes = ["those of " + ", ".join(list(FIXES)[:4]) + " together"]
    more = next((k * n_gpus for k in (2, 4, 8)
                 if _fits(cfg, shape, k * n_gpus, capacity, shared)), None)
    if more is not None:
        fixes.append(f"{more} trainer GPUs (launch.nproc)")
    hint = ("; it would fit with " + " or ".join(fixes)) if fixes else \
        "; no option makes it fit: use a smaller model or more GPUs"
    if busy:
        hint += " (or free the GPUs that other processes hold)"
    raise ConfigError(f"engine: the run does not fit one GPU, {line}, more than "
                      f"{HEADROOM:.0%} of the device{hint}")
