"""What ``fsdpfn run`` checks before it starts anything: in seconds, with one line per refusal.

    preflight(cfg, placement, data=True)

- the data files are readable and hold the columns the recipe reads (fsdpfn.app.recipes.data);
- the reward function imports and can be called the way the recipe calls it;
- the rollout workflow imports, and with max_staleness an external server is fsdpfn's (it
  takes updates mid-request);
- the longest row the data allows fits the model's ``max_position_embeddings`` (the micro-batch
  budget and cp were checked with the config: fsdpfn.app.recipes.engine.check_budget);
- tp divides the model's heads, and a step has work for every data-parallel rank
  (fsdpfn.app.recipes.placement.check_parallel); engine.lora.target_modules name linear layers
  of the model's decoder layers, and a wrap_policy module classes of the model;
- each batch a step holds on the host (its rows at the longest row) against the host's
  available memory;
- the run's size against the room it has (fsdpfn.app.recipes.memory): one checkpoint against
  the run_dir's free disk space; on a GPU host, an estimate of one trainer GPU's memory against
  the device's (read here, from nvidia-smi) and the state an option keeps in host memory
  against the host's available memory, and each rollout server on a GPU of its own against
  that GPU's (fsdpfn.app.recipes.server_memory). A run that cannot fit is refused, naming the
  options that would make it fit;
- a user's model family against the engine's refusals (mixture-of-experts, encoder-decoder,
  multimodal, ALiBi, a critic without a ``score`` head, ...), for each role the recipe trains:
  the line the ranks would stop on, before anything starts (check_family);
- with ``data`` (``--dry-run``), also the data files tokenized, as the launcher's own data
  step does in a real run.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import attrs

from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.cpu_memory import check_cpu_memory
from fsdpfn.app.recipes.engine import engines, longest_row
from fsdpfn.app.recipes.memory import (ModelShape, check_batch_rows, check_disk,
                                       check_host_memory, check_memory)
from fsdpfn.app.recipes.placement import check_parallel
from fsdpfn.app.recipes.server_memory import check_server_memory
from fsdpfn.engine.host import available_host_memory

__all__ = ["preflight", "check_data", "check_reward", "check_rollout", "check_positions",
           "check_lora_targets", "check_wrap_policy", "check_family", "model_config"]


def preflight(cfg, placement, *, data: bool = True) -> list[str]:
    """Run every check; returns notes for the terminal (the memory estimate on GPU hosts).
    ``placement`` None (``fsdpfn run --prepare``: torchrun places the ranks, on other hosts):
    the checks of the hosts (parallel layout, memory) are left to the ranks."""
    needs_rollout = cfg.recipe in ("grpo", "ppo")
    if data:
        check_data(cfg)
    check_family(cfg)
    if needs_rollout:
        check_reward(cfg)
        check_rollout(cfg)
    hf = model_config(cfg)
    check_positions(cfg, hf)
    if placement is not None:
        check_parallel(cfg, placement, hf)  # fsdpfn.app.recipes.placement
    check_lora_targets(cfg)
    check_wrap_policy(cfg, hf)
    check_batch_rows(cfg, available=available_host_memory())
    shape = ModelShape.from_hf(hf)
    if not cfg.model.embedded and not cfg.model.random_init:  # the files' own counts
        shape = shape.counted(cfg.model.path)
    notes = [check_disk(cfg, shape)]
    if placement is None:
        return notes
    if placement.device != "cuda":
        host = check_cpu_memory(cfg, shape, placement, available=available_host_memory())
        return notes + ([host] if host else [])
    capacity_of = _gpu_memory()
    capacity, busy = capacity_of(placement.trainer_gpus or (0,), placement.server_gpus)
    notes.append(check_memory(cfg, shape, n_gpus=placement.nproc, capacity=capacity,
                              shared=_shares_gpu(placement), busy=busy))
    if placement.server_gpus and not _shares_gpu(placement):  # servers on GPUs of their own
        free, said = capacity_of(placement.server_gpus)
        notes.append(check_server_memory(cfg, shape, gpus=placement.server_gpus, capacity=free,
                                         dtype=placement.dtype, busy=said))
    host = check_host_memory(cfg, shape, available=available_host_memory())
    return notes + ([host] if host else [])


# ---------------------------------------------------------------- data, reward, positions


# the linear layers of the embedded model's decoder layers (a Qwen2)
EMBEDDED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_lora_targets(cfg) -> None:
    """engine.lora.target_modules name linear layers of the decoder layers, read from the
    weights' safetensors headers (2-D ``*.layers.N.<...>.<leaf>.weight`` tensors, no tensor
    loaded): the rule shard_model applies, before anything starts. The embedded model's are
    Qwen2's; a model built from its config alone (random_init) has no weights to read:
    shard_model checks it."""
    import re

    lora = cfg.engine.lora
    if lora is None or tuple(lora.target_modules) == ("all-linear",) or cfg.model.random_init:
        return
    present = set(EMBEDDED_LINEARS) if cfg.model.embedded else set()
    if not cfg.model.embedded:
        from safetensors import safe_open

        layer_weight = re.compile(r"(?:^|\.)layers\.\d+\.(?:.+\.)?([^.]+)\.weight$")
        for file in sorted(Path(cfg.model.path).glob("*.safetensors")):
            with safe_open(str(file), framework="numpy") as handle:
                for key in handle.keys():
                    match = layer_weight.search(key)
                    if match and len(handle.get_slice(key).get_shape()) == 2:
                        present.add(match.group(1))
    missing = [t for t in lora.target_modules if t not in present]
    if present and missing:
        raise ConfigError(f"engine.lora.target_modules: must name linear layers of the decoder "
                          f"layers ({sorted(present)}) or be ['all-linear'], got {missing}")


def check_wrap_policy(cfg, hf: dict) -> None:
    """engine.fsdp.wrap_policy (and the reference's or critic's) name module classes of the
    model: the rule shard_model applies, checked on the model built on the meta device from its
    config (no weights), and only when a section sets one: it imports the modelling code."""
    from fsdpfn.app.recipes.engine import engines

    policies = {f"{key}.fsdp.wrap_policy": tuple(section.fsdp.wrap_policy)
                for key, section in engines(cfg).items() if section.fsdp.wrap_policy is not None}
    if not policies:
        return
    import torch
    import transformers

    fields = dict(hf)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    present = {type(m).__name__ for m in model.modules()}
    for key, names in policies.items():
        missing = [n for n in names if n not in present]
        if missing:
            raise ConfigError(f"{key}: must name module classes of the model (e.g. "
                              f"{sorted(n for n in present if 'Layer' in n)}), got {missing}")


def check_data(cfg) -> None:
    """Each split's files exist, read, have the columns this recipe needs and rows of the
    right types: the checks prepare_files makes before it tokenizes (which it does when the
    run starts)."""
    from fsdpfn.app.recipes.data import answer_reason, columns_for
    from fsdpfn.app.recipes.data_rows import check_rows, read_rows

    why = answer_reason(cfg)
    for files, key in ((cfg.data.train_files, "train_files"), (cfg.data.eval_files,
                                                                 "eval_files")):
        if files:
            data = read_rows(files, key)
            check_rows(data, columns_for(cfg.data, cfg.recipe, list(data.columns), key,
                                         answer_reason=why), cfg.recipe)


def _reward_call(cfg) -> tuple[tuple, dict, str]:
    kw = dict(cfg.reward.kwargs)
    if cfg.reward.batched:
        return (["p"], ["c"]), {"answers": [None], "samples": [{}], **kw}, \
            "fn(prompts, completions, *, answers, samples" + "".join(f", {k}" for k in kw) + ")"
    return ("p", "c"), {"answer": None, "sample": {}, **kw}, \
        "fn(prompt, completion, *, answer, sample" + "".join(f", {k}" for k in kw) + ")"


def check_reward(cfg) -> None:
    """The reward imports (reward.fn, or the task's built-in one) and its signature accepts the
    call the recipe makes: fn(prompt, completion, *, answer, sample, **reward.kwargs), or the
    batched form with reward.batched."""
    from fsdpfn.app.recipes import _reward_worker as W
    from fsdpfn.app.recipes.reward import load_reward, reward_spec

    spec = reward_spec(cfg)
    fn = load_reward(spec)
    if W.yields(fn):
        raise ConfigError(f"reward.fn: must return the reward, not yield it (calling a generator "
                          f"function returns a generator, not a number), got {spec!r}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return
    args, kwargs, shape = _reward_call(cfg)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"reward.fn: {spec!r} must accept {shape} (reward.batched="
                          f"{str(cfg.reward.batched).lower()}); its signature {sig} does not "
                          f"({exc}), got {spec!r}") from None


def check_rollout(cfg) -> None:
    """The built-in server's packages are installed where the run starts one; a workflow
    imports and takes (client, row), with an advantage estimator that groups its
    episodes per data row; generation ahead of training needs a server that tags each token
    with its weights version and takes updates mid-request (fsdpfn's own)."""
    r, adv = cfg.rollout, cfg.advantage
    if not r.url:  # the run starts fsdpfn's own servers: this Python must be able to
        from fsdpfn.rollout.process import missing_server_packages

        lacking = missing_server_packages()
        if lacking is not None:
            raise ConfigError(f"rollout.url: null starts fsdpfn's rollout server, which "
                              f"{lacking}; or set rollout.url to a running server, got None")
    if r.workflow:
        from fsdpfn.app.recipes.workflow import load_workflow

        load_workflow(r.workflow)
        if adv.estimator not in ("grpo", "drgrpo", "rloo"):
            raise ConfigError(f"rollout.workflow: episodes are grouped per data row; "
                              f"advantage.estimator must be 'grpo', 'drgrpo' or 'rloo', got "
                              f"{adv.estimator!r}")
        for name in ("kl_coef", "whiten", "reward_clip", "reward_scale", "reward_bias"):
            default = attrs.fields_dict(type(adv))[name].default
            if getattr(adv, name) != default:
                raise ConfigError(f"advantage.{name}: not applied to workflow episodes (their "
                                  f"advantages are the group statistics alone), got "
                                  f"{getattr(adv, name)!r}; use ppo.kl_coef for a KL term")
    if r.max_staleness and r.url:
        for url in r.urls:  # every external server must take updates mid-request
            _check_external_server(url)


def _check_external_server(url: str) -> None:
    """rollout.max_staleness >= 1 with rollout.url: the server must be fsdpfn's (per-token
    versions, in-flight updates); a stock SGLang server pauses or retracts requests around an
    update and names one version per request, so staleness could not be bounded."""
    from fsdpfn.wire.http import call

    try:
        info = call(url, "/get_model_info", None, timeout=10.0)
    except Exception as exc:  # noqa: BLE001 - unreachable: say so, before launch
        raise ConfigError(f"rollout.max_staleness: checking the server at rollout.url={url!r} "
                          f"failed ({exc}); it must be reachable before launch") from None
    if not isinstance(info, dict) or "server_id" not in info or "version" not in info:
        raise ConfigError(f"rollout.max_staleness: the server at rollout.url={url!r} is not "
                          f"fsdpfn's rollout server: generation ahead of training needs each "
                          f"token's weights version and updates that land mid-request (SGLang "
                          f"pauses or retracts requests around an update); use max_staleness: 0 "
                          f"with it, or fsdpfn's server")


def check_family(cfg) -> None:
    """A user's model whose family the engine refuses on its config alone (families.refusal)
    or on its modules' names (families.check_structure: a critic's value head ``score``, the
    decoder layers LoRA wraps), for each role it would train: the policy, and a critic for rw
    and ppo; the same line the ranks would stop on, before run_dir, the servers and the ranks.
    The structure is read from a meta skeleton of a small probe of the architecture. The
    guard's forward comparison, and a config.json transformers cannot read (an unknown
    model_type, inconsistent fields), are left to the ranks' build, which refuses those by
    name. This costs a user's model's launch the import of transformers (a run from data
    files loads its tokenizer through it anyway); the embedded model's launch imports neither."""
    if cfg.model.embedded:
        return
    from transformers import AutoConfig

    from fsdpfn.engine.families import check_refusals

    try:
        hf = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
    except Exception:  # noqa: BLE001 - what transformers cannot read, the ranks refuse by name
        return
    roles = sorted({(name == "critic_engine" or cfg.recipe == "rw", section.lora is not None)
                    for name, section in engines(cfg).items()})
    try:
        for is_critic in sorted({critic for critic, _ in roles}):
            check_refusals(hf, is_critic=is_critic)
        for is_critic, lora in roles:
            if is_critic or lora:
                _check_structure(hf, is_critic=is_critic, lora=lora)
    except ConfigError as exc:
        raise ConfigError(f"model.path: {exc}") from None


def _check_structure(hf, *, is_critic: bool, lora: bool) -> None:
    import torch

    from fsdpfn.engine.families import check_structure, probe_config
    from fsdpfn.engine.load_weights import build_skeleton

    try:
        lm = build_skeleton(probe_config(hf), is_critic=is_critic, dtype=torch.float32,
                            device="meta")
    except Exception:  # noqa: BLE001 - a family that does not build, the ranks refuse by name
        return
    try:
        check_structure(lm, model_type=hf.model_type, is_critic=is_critic, lora=lora)
    except ConfigError as exc:  # the engine's field (is_critic, lora) is the rank's to name
        raise ConfigError(str(exc).partition(": ")[2]) from None


def model_config(cfg) -> dict:
    """The model's config.json as a dict (the text model's, for multimodal configs), or the
    embedded model's shape; a config.json that does not read is refused by name."""
    from fsdpfn.app.recipes.model import text_model_config

    if cfg.model.embedded:
        return cfg.model.config_dict(64)
    return text_model_config(cfg.model.path)


def check_positions(cfg, hf: dict | None) -> None:
    """The longest row the data allows must fit the model's position embeddings."""
    limit = (hf or {}).get("max_position_embeddings")
    if not isinstance(limit, int):
        return
    row, how = longest_row(cfg)
    if row > limit:
        where = "model.path's config.json" if cfg.model.path else "the embedded model"
        raise ConfigError(f"data.max_response_tokens: {how} = {row} tokens must be <= "
                          f"max_position_embeddings = {limit} ({where}); lower "
                          f"data.max_prompt_tokens or data.max_response_tokens, got "
                          f"{cfg.data.max_response_tokens}")


# ---------------------------------------------------------------- the devices


def _gpu_memory():
    """A function of (GPU indices, other GPUs of the run) -> (bytes free on the fullest of
    them, what other processes hold on all of them), from one nvidia-smi query (asking torch
    would start CUDA in the launcher, which would then hold device memory for the whole run).
    Where it cannot tell which GPUs they are (MIG), the host's smallest GPU's total; without
    nvidia-smi, torch's figure for the first of them."""
    from fsdpfn.app.recipes.gpu_memory import host_gpus, trainer_capacity, visible

    gpus = host_gpus()
    seen = visible(gpus) if gpus else None

    def capacity(which: tuple[int, ...], others: tuple[int, ...] = ()) -> tuple[float, str]:
        if seen and all(i < len(seen) for i in which):
            return trainer_capacity(seen, which, others)
        if gpus:
            return min(g.total for g in gpus), ""
        import torch

        return float(torch.cuda.get_device_properties(which[0]).total_memory), ""

    return capacity


def _shares_gpu(placement) -> bool:
    return bool(placement.server_gpus) and bool(
        set(placement.server_gpus) & set(placement.trainer_gpus))
