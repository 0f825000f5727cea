"""Recipe configs: one frozen attrs class per recipe, composed of fsdpfn's own configs.

A YAML file names its recipe (``recipe: grpo``) and is validated by fsdpfn's one cattrs converter
(``fsdpfn.serde``): unknown keys are rejected (naming the closest valid one), and errors name the
dotted path, the rule and the value (``ppo.clip_low: must be < 1, got 1.5``). Print any recipe's
full default config with ``fsdpfn config NAME``.

``engine:`` is the policy's EngineConfig (precision, micro-batch budget, checkpointing, FSDP
offload, LoRA, kernels: fsdpfn.app.recipes.engine); ``ref_engine:`` and ``critic_engine:`` override
it for the reference model and ppo's critic. An explicit micro-batch budget below the longest row
the data allows is refused here, before anything starts.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from fsdpfn.config import (AdvantageConfig, CriticConfig, DPOConfig, OptimizerConfig,
                           ParallelStrategy, PPOConfig, RWConfig, SFTConfig)
from fsdpfn.errors import ConfigError
from fsdpfn.validators import (boolean, fail, integer, is_nonempty_str, number, one_of, satisfies,
                               to_float, to_opt_float)
from fsdpfn.wire.http import is_http_url
from fsdpfn.app.recipes.data import DataConfig
from fsdpfn.app.recipes.engine import MOVED, EngineSection, check_recipe_engines
from fsdpfn.app.recipes.model import ModelConfig
from fsdpfn.app.recipes.reward import RewardConfig
from fsdpfn.app.recipes.task import AdditionTask

__all__ = ["ModelConfig", "DataConfig", "RewardConfig", "LaunchConfig", "RolloutConfig",
           "CheckpointConfig", "LogConfig", "WandbConfig", "WarmupConfig", "EvalConfig",
           "Recipe", "GRPORecipe", "PPORecipe", "SFTRecipe", "RWRecipe", "DPORecipe", "RECIPE_CONFIGS"]


_path = satisfies("must be a non-empty path string", is_nonempty_str)
_opt_str = satisfies("must be null or a non-empty string", is_nonempty_str, optional=True)


def _gpus(value):
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str):
        value = [int(v) if v.isdecimal() else v for v in value.replace(" ", "").split(",") if v]
    return tuple(value) if isinstance(value, list) else value


def _distinct_indices(value) -> bool:
    return isinstance(value, tuple) and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value) \
        and len(set(value)) == len(value)


_gpu_list = satisfies("must be null or a list of distinct GPU indices >= 0", _distinct_indices,
                      optional=True,
                      show=lambda v: repr(list(v) if isinstance(v, tuple) else v))


@attrs.frozen
class LaunchConfig:
    """How ``fsdpfn run`` starts the trainer: ``nproc`` ranks on this host (gloo on CPU, NCCL on
    CUDA; started as torchrun would, without it), each with ``threads_per_rank`` CPU threads (OMP_NUM_THREADS). ``device: auto`` uses
    CUDA when a GPU is visible. ``gpus``: the GPU indices the trainer ranks use (one rank per
    GPU; null: every GPU the rollout server does not use, or GPU 0 when there is only one).
    ``nproc: null``: one rank per trainer GPU on CUDA, 2 on CPU."""

    nproc: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))
    threads_per_rank: int = attrs.field(default=1, validator=integer(1))
    device: str = attrs.field(default="auto", validator=one_of("cpu", "cuda", "auto"))
    gpus: tuple[int, ...] | None = attrs.field(default=None, converter=_gpus,
                                               validator=_gpu_list)
    master_port: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))


def _urls(value):
    """rollout.url as one string: a list of URLs (YAML) is kept comma-separated, each stripped
    of spaces and a trailing slash; anything else is left to the validator."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if isinstance(value, str):
        return ",".join(v.strip().rstrip("/") for v in value.split(","))
    return list(value) if isinstance(value, tuple) else value


def _server_args(value):
    """rollout.server_args as a tuple of strings: a YAML list (numbers written as text:
    ``[--decode-rows, 64]``), or one string (``--decode hf``) split as a shell would; anything
    else is left to the validator."""
    import shlex

    if value is None:
        return ()
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # fsdpfn.serde reads one string as a list of one
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError:  # an unclosed quote: the validator names it
            return value
    if isinstance(value, (list, tuple)):
        return tuple(str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                     for v in value)
    return value


# flags of python -m fsdpfn.rollout that fsdpfn run sets itself -> the key that sets them
SERVER_OWNED = {
    "--model": "model.path (the run's starting model)", "--port": "fsdpfn run (a free port)",
    "--host": "fsdpfn run (127.0.0.1)", "--dtype": "engine.dtype",
    "--device": "rollout.device and rollout.gpus", "--threads": "rollout.threads",
    "--load-format": "model.random_init", "--wait-for-model": "rollout.health_timeout_s",
    "--parent-pid": "fsdpfn run (the launcher's pid)",
    "--weight-version": "fsdpfn run (the trainer's pushes)",
    "--no-channel": "fsdpfn run (the trainer pushes over the channel)",
    "--channel-port": "fsdpfn run (a free port)"}


def _server_namespace(args, error=None):
    """The server's parsed command line with these flags (fsdpfn run's own as placeholders),
    flags written out in full; ``error`` is called with argparse's message instead of exiting."""
    from fsdpfn.rollout.__main__ import parser

    check = parser(allow_abbrev=False)
    if error is not None:
        check.error = error
    return check.parse_args(["--model", "m", "--port", "0", *args])


def _check_server_args(instance, attribute, value) -> None:
    """Each flag must be one python -m fsdpfn.rollout accepts, with a valid value, and not one
    fsdpfn run sets itself; with rollout.url (external servers) there is no server to pass
    them to."""
    import argparse

    name = attribute.name
    if isinstance(value, str):
        fail(name, "must be a list of flags, or one string a shell can split (quotes closed)",
             value)
    if not isinstance(value, tuple) or not all(is_nonempty_str(v) for v in value):
        fail(name, "must be a list of flags of python -m fsdpfn.rollout (non-empty strings)",
             value)
    shown = repr(list(value))
    for v in value:
        flag = v.split("=", 1)[0]
        if flag in SERVER_OWNED:
            fail(name, f"must not set {flag}, which comes from {SERVER_OWNED[flag]}", value,
                 shown=shown)
    def refuse(message: str):
        fail(name, "must be flags python -m fsdpfn.rollout accepts", value,
             shown=f"{shown} ({message})")

    try:
        _server_namespace(value, refuse)
    except argparse.ArgumentError as exc:
        refuse(str(exc))
    if instance is not None and value and instance.url is not None:
        fail(name, "must be empty when rollout.url names external servers (the flags go to the "
             "servers fsdpfn run starts)", value, shown=shown)


# sampling parameters a recipe sets itself -> the key that sets them
SAMPLING_OWNED = {"temperature": "rollout.temperature", "top_p": "rollout.top_p",
                  "n": "advantage.group_size", "seed": "seed", "sampling_seed": "seed",
                  "max_new_tokens": "data.max_response_tokens (task.max_answer_tokens for the "
                                    "built-in task)"}


def _check_sampling(instance, attribute, value) -> None:
    """Sampling parameters the server accepts (fsdpfn.rollout.SamplingParams' own rules), none
    of them one the recipe sets itself."""
    import difflib

    from fsdpfn.rollout.errors import UpdateError
    from fsdpfn.rollout.sampling import INERT, REFUSED, SamplingParams

    name = attribute.name
    if not isinstance(value, dict) or not all(is_nonempty_str(k) for k in value):
        fail(name, "must be a mapping of sampling parameters (fsdpfn.rollout.SamplingParams)",
             value)
    for key, v in value.items():
        if key in SAMPLING_OWNED:
            fail(f"{name}.{key}", f"must not be set here: it comes from {SAMPLING_OWNED[key]}",
                 v)
    allowed = sorted(set(SamplingParams.FIELDS) - set(SAMPLING_OWNED))
    unknown = sorted(set(value) - set(SamplingParams.FIELDS) - set(REFUSED) - set(INERT))
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        raise ConfigError(f"{name}: unknown key(s) {unknown}"
                          + (f"; did you mean {close[0]!r}?" if close else "")
                          + f" (allowed: {', '.join(allowed)})")
    try:
        SamplingParams(**value)
    except UpdateError as exc:  # "sampling_params.top_k: must be ..., got ..."
        raise ConfigError(name + str(exc).removeprefix("sampling_params")) from None
    if instance is not None and value and instance.workflow is not None:
        fail(name, "must be empty with rollout.workflow (the workflow's own calls choose their "
             "sampling)", value)


@attrs.frozen
class RolloutConfig:
    """The rollout server. ``url=None``: ``fsdpfn run`` starts ``python -m fsdpfn.rollout`` on
    the run's initial model and stops it at the end; else the trainer uses the server at ``url``
    (it must serve a model of the same architecture). Weights are pushed after every step over
    ``transport`` ("broadcast": a gloo/NCCL group; "ipc": CUDA IPC handles, for a server on
    trainer rank 0's GPU; "disk": safetensors under run_dir/push; "auto": broadcast, or ipc
    when trainer and server share a GPU, where NCCL cannot connect two processes). ``device:
    auto`` follows the trainer; ``gpus``: the servers' GPUs, one server per GPU listed (null:
    the host's last ``servers`` GPUs; the trainer takes the GPUs no server uses).

    Several servers: ``gpus: [4, 5, 6, 7]`` starts four (the 8-GPU shape of 4 trainer GPUs and
    4 serving), ``servers: N`` starts N (on the CPU, or on the host's last N GPUs; default
    len(gpus), or 1), and ``url`` may list external servers (a YAML list, or comma-separated).
    Each group of answers goes to one server, the least loaded (fsdpfn.rollout.balance), and
    every push reaches all of them through one update group (their versions and checksums must
    agree). Several servers need GPUs of their own: none may be a trainer GPU (so ``transport:
    ipc``, which shares rank 0's GPU, is for one server). ``gpus`` places servers that fsdpfn
    run starts on CUDA; where it cannot apply (``device: cpu``, ``url``, a host without GPUs)
    it is refused before launch, never ignored.

    ``max_staleness``: 0 is the synchronous loop (generate, then train, then push); N >= 1 lets
    generation run up to N steps ahead of training (fsdpfn.rollout.stream: no trained sample is
    more than N weight versions old, nothing is thrown away; pushes then land without pausing
    generation). ``workflow``: "pkg.module:function" or "path.py:function", called once per
    sample with an openai client and the data row, returning the episode's reward
    (fsdpfn.app.recipes.workflow), each call bounded by ``workflow_timeout_s``; an episode's row
    longer than ``max_episode_tokens`` (null: the model's max_position_embeddings) is dropped
    and counted."""

    url: str | None = attrs.field(default=None, converter=_urls)
    # how many built-in servers fsdpfn run starts (null: one per rollout.gpus entry, else 1)
    servers: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))
    transport: str = attrs.field(default="auto",
                                 validator=one_of("auto", "broadcast", "ipc", "disk"))
    threads: int = attrs.field(default=1, validator=integer(1))
    device: str = attrs.field(default="auto", validator=one_of("auto", "cpu", "cuda"))
    # the servers' GPUs, one server each (null: the host's last `servers` GPUs); for servers
    # fsdpfn run starts on CUDA: refused with device cpu, with url and on a host without GPUs
    gpus: tuple[int, ...] | None = attrs.field(default=None, converter=_gpus,
                                               validator=_gpu_list)
    temperature: float = attrs.field(default=1.0, converter=to_float, validator=number(gt=0))
    top_p: float = attrs.field(default=1.0, converter=to_float, validator=number(gt=0, le=1))
    timeout_s: float = attrs.field(default=120.0, converter=to_float, validator=number(gt=0))
    # how long the servers fsdpfn run starts may take to answer /health, and how long the
    # trainer waits for the external servers of url to answer it (one bound for all of them)
    health_timeout_s: float = attrs.field(default=300.0, converter=to_float,
                                          validator=number(gt=0))
    max_staleness: int = attrs.field(default=0, validator=integer(0))
    workflow: str | None = attrs.field(default=None, validator=_opt_str)
    workflow_timeout_s: float = attrs.field(default=600.0, converter=to_float,
                                            validator=number(gt=0))
    max_episode_tokens: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))
    # flags added to each rollout server fsdpfn run starts (`python -m fsdpfn.rollout --help`):
    # the decode loop's kernels, rows and lengths, HF generate (--decode hf), CUDA graphs;
    # checked before launch, and a flag fsdpfn run sets itself is refused naming its key
    server_args: tuple[str, ...] = attrs.field(default=(), converter=_server_args,
                                               validator=_check_server_args)
    # more sampling parameters for every generation request (fsdpfn.rollout.SamplingParams:
    # top_k, min_p, stop, stop_token_ids, the penalties, ...), checked before launch; the
    # held-out eval (greedy) takes those that decide where an answer ends. The decode loop
    # serves top_k and stops; min_p, min_new_tokens and the penalties need HF generate
    # (server_args: [--decode, hf] on a GPU). A workflow's calls choose their own
    sampling: dict = attrs.field(factory=dict, validator=_check_sampling)

    @url.validator
    def _check_url(self, attribute, value):
        if value is None:
            return
        if not is_nonempty_str(value):
            fail("url", "must be None, 'http://host:port' or a list of them", value)
        urls = value.split(",")
        for u in urls:
            if not is_http_url(u):
                fail("url", "must name each server as 'http://host:port'", u,
                     shown=repr(u) + (f" in {urls}" if len(urls) > 1 else ""))
        twice = [u for u in urls if urls.count(u) > 1]
        if twice:
            fail("url", "must name each server once", urls, shown=f"{twice[0]!r} twice in {urls}")

    def __attrs_post_init__(self):
        self._check_external()
        if self.gpus is not None and self.device == "cpu":
            fail("gpus", "must be null with rollout.device 'cpu' (GPU indices place servers on "
                         "CUDA; rollout.servers=N starts N on the CPU)", self.gpus,
                 shown=repr(list(self.gpus)))
        if self.servers is not None and self.gpus is not None \
                and self.servers != len(self.gpus):
            fail("servers", f"must equal the number of rollout.gpus (one server per GPU listed: "
                            f"{list(self.gpus)})", self.servers)
        if self.url is not None and self.servers is not None and self.servers != len(self.urls):
            fail("servers", f"must equal the number of servers rollout.url lists "
                            f"({len(self.urls)}; fsdpfn run starts none then)", self.servers)

    def _check_external(self) -> None:
        """With url (external servers) nothing is placed: gpus cannot apply, and ipc, which
        hands CUDA memory to a server fsdpfn run starts on trainer rank 0's GPU, cannot
        either."""
        if self.url is None:
            return
        if self.gpus is not None:
            fail("gpus", "must be null when rollout.url names external servers (fsdpfn run "
                         "starts no server to place)", self.gpus, shown=repr(list(self.gpus)))
        if self.transport == "ipc":
            fail("transport", "must not be 'ipc' when rollout.url names external servers (ipc "
                              "hands CUDA memory of trainer rank 0's GPU to a server fsdpfn run "
                              "starts on that GPU); use auto, broadcast or disk", self.transport)

    @property
    def urls(self) -> tuple[str, ...]:
        """The external servers' URLs (empty: fsdpfn run starts its own)."""
        return tuple(self.url.split(",")) if self.url else ()

    @property
    def n_servers(self) -> int:
        """How many servers the run talks to: the URLs listed, else ``servers``, else one per
        GPU in ``gpus``, else 1."""
        if self.url:
            return len(self.urls)
        return self.servers or (len(self.gpus) if self.gpus else 1)


@attrs.frozen
class CheckpointConfig:
    """Save every ``every`` steps (0: only at the end) into run_dir/checkpoints/step_N, keeping
    the ``keep_last`` newest. A clean stop (Ctrl-C) also saves the last finished step.

    ``async_save``: a periodic save copies the state's shards to host memory and training goes
    on while a background thread writes and publishes them; at most one save is in flight (the
    next save, the end of the run and a clean stop wait for it, and the end-of-run save is
    written directly). The checkpoint holds exactly the state of its step, as a synchronous save
    would, and a crash mid-write leaves the previous checkpoint as the one ``--resume`` reads.
    Cost: host memory for one copy of each rank's shards (fp32 weights and Adam moments, about
    12 bytes per parameter divided by the dp x tp x cp ranks, times the ranks on the host)
    while the save runs; a save whose copy exceeds half the host's available memory is written
    synchronously instead, with a log line. Turn it off when host memory is needed elsewhere
    (CPU-offloaded optimizer state, data in memory) or to time steps with their saves.
    Metrics: ``checkpoint_seconds`` (what the step was blocked), ``checkpoint_copy_bytes``,
    and on the row where a save has published, ``checkpoint`` and ``checkpoint_write_seconds``
    (from its start to its publication)."""

    every: int = attrs.field(default=10, validator=integer(0))
    keep_last: int = attrs.field(default=2, validator=integer(1))
    async_save: bool = attrs.field(default=True, validator=boolean)


@attrs.frozen
class WandbConfig:
    """Weights & Biases: every metrics row logged to ``project`` as run ``name`` (null: the
    run_dir's name), files under run_dir/wandb. ``mode``: online, offline (no network; sync
    later with ``wandb sync run_dir/wandb/offline-run-*``) or disabled. A resumed run continues
    the same W&B run."""

    project: str = attrs.field(default="fsdpfn", validator=_path)
    name: str | None = attrs.field(default=None, validator=_opt_str)
    mode: str = attrs.field(default="online", validator=one_of("online", "offline", "disabled"))


@attrs.frozen
class LogConfig:
    """Progress bar on stderr (a line every ``every`` steps when stderr is not a terminal),
    metrics as JSON lines in run_dir/metrics.jsonl, a PNG plot at the end, TensorBoard event
    files in run_dir/tensorboard with ``tensorboard: true`` (needs the tensorboard package),
    and Weights & Biases with ``wandb: {project, name, mode}`` (needs the wandb package)."""

    progress: bool = attrs.field(default=True, validator=boolean)
    every: int = attrs.field(default=1, validator=integer(1))
    plot: bool = attrs.field(default=True, validator=boolean)
    tensorboard: bool = attrs.field(default=False, validator=boolean)
    wandb: WandbConfig | None = attrs.field(default=None)


@attrs.frozen
class WarmupConfig:
    """Supervised warm-up before RL (sft_step on solved problems); its result is the reference
    model and the starting point of RL. It ends after ``steps`` steps, or earlier once the
    expected reward of sampling (mean over held-out problems of P(correct answer) =
    exp(Σ logp of its tokens), checked every ``check_every`` steps) reaches ``target_reward``
    (None: never early). steps=0 skips it."""

    steps: int | None = attrs.field(default=None, validator=integer(0, allow=(None,)))
    batch_size: int = attrs.field(default=128, validator=integer(1))
    target_reward: float | None = attrs.field(default=0.35, converter=to_opt_float,
                                              validator=number(gt=0, le=1, optional=True))
    check_every: int = attrs.field(default=10, validator=integer(1))
    optimizer: OptimizerConfig = attrs.field(
        factory=lambda: OptimizerConfig(lr=2e-3, warmup_steps=50))


@attrs.frozen
class EvalConfig:
    """Greedy accuracy on ``n_prompts`` held-out problems every ``every`` steps (0: off)."""

    every: int = attrs.field(default=0, validator=integer(0))
    n_prompts: int = attrs.field(default=128, validator=integer(1))


def _check_rl_data(cfg) -> None:
    """What an RL recipe needs beyond each section's own rules."""
    rows = cfg.prompts_per_step * cfg.advantage.group_size
    for name in ("ppo", "critic") if cfg.recipe == "ppo" else ("ppo",):
        if getattr(cfg, name).n_minibatches > rows:
            raise ConfigError(f"{name}.n_minibatches: must be <= the rows of a step "
                              f"(prompts_per_step x advantage.group_size = "
                              f"{cfg.prompts_per_step} x {cfg.advantage.group_size} = {rows}; "
                              f"an empty minibatch trains on nothing), got "
                              f"{getattr(cfg, name).n_minibatches}")
    args = cfg.rollout.server_args
    if any(a.split("=", 1)[0] == "--decode-max-len" for a in args):
        from fsdpfn.app.recipes.engine import longest_row

        cache = _server_namespace(args).decode_max_len
        row, how = longest_row(cfg)
        if cache < row:
            raise ConfigError(f"rollout.server_args: --decode-max-len must be >= {how} = {row} "
                              f"tokens (the longest row the data allows), got {cache}")
    if cfg.data.from_files and cfg.warmup.steps:
        raise ConfigError(f"warmup.steps: the supervised warm-up trains on solved problems of "
                          f"the embedded task; with data.train_files it must be 0 or null (run "
                          f"recipe 'sft' first and set model.path to its export), got "
                          f"{cfg.warmup.steps}")
    _check_model_data(cfg)


def _check_model_data(cfg) -> None:
    check_recipe_engines(cfg)
    if cfg.data.from_files and cfg.model.embedded:
        raise ConfigError("model.path: data files need the model's own tokenizer; set "
                          "model.path to an HF model directory, got None (the embedded "
                          "character model reads only the addition task)")


def _own(key: str):
    """A shared field's default, from the recipe class's ``DEFAULTS`` (configs are frozen, so
    one default instance serves every config)."""
    return attrs.Factory(lambda self: type(self).DEFAULTS[key], takes_self=True)


def _check_recipe(instance, attribute, value) -> None:
    name = type(instance).DEFAULTS["recipe"]
    if value != name:
        fail(attribute.name, f"must be {name!r} for this config class", value)


@attrs.frozen
class Recipe:
    """What every recipe config holds, in this order: its name, run directory, seed and length;
    the embedded task or the user's data, the model, parallelism, the ``engine:`` section and its
    optimizer; launch, checkpoints and logging. A recipe class adds its own sections after these
    and gives its defaults for the shared ones in ``DEFAULTS``."""

    DEFAULTS: ClassVar[dict] = {}

    recipe: str = attrs.field(default=_own("recipe"), validator=_check_recipe)
    run_dir: str = attrs.field(
        default=attrs.Factory(lambda self: f"runs/{self.recipe}", takes_self=True),
        validator=_path)
    seed: int = attrs.field(default=0, validator=integer(0))
    steps: int = attrs.field(default=_own("steps"), validator=integer(1))
    task: AdditionTask = attrs.field(default=_own("task"))
    model: ModelConfig = attrs.field(factory=ModelConfig)
    data: DataConfig = attrs.field(factory=DataConfig)
    parallel: ParallelStrategy = attrs.field(factory=ParallelStrategy)
    engine: EngineSection = attrs.field(factory=EngineSection)
    optimizer: OptimizerConfig = attrs.field(default=_own("optimizer"))
    launch: LaunchConfig = attrs.field(factory=LaunchConfig)
    checkpoint: CheckpointConfig = attrs.field(default=_own("checkpoint"))
    log: LogConfig = attrs.field(factory=LogConfig)


@attrs.frozen
class GRPORecipe(Recipe):
    """GRPO on the addition task: SFT warm-up, then per step: the rollout server samples
    ``advantage.group_size`` answers for each of ``prompts_per_step`` problems; rewards; ref and
    old log-probs (forward_logp); group advantages; ppo_step (decoupled PPO with the server's
    behav_logp); push_weights; checkpoint on schedule. ``engine.lora``: train adapters only (the
    warm-up too, exported merged); ref_logp is then the actor with its adapters disabled (one
    model in memory) and pushes carry the merged weights."""

    DEFAULTS: ClassVar[dict] = {"recipe": "grpo", "steps": 80, "task": AdditionTask(),
                                "optimizer": OptimizerConfig(lr=2e-4),
                                "checkpoint": CheckpointConfig()}

    prompts_per_step: int = attrs.field(default=64, validator=integer(1))
    ref_engine: dict = attrs.field(factory=dict, hash=False)
    warmup: WarmupConfig = attrs.field(factory=WarmupConfig)
    advantage: AdvantageConfig = attrs.field(
        factory=lambda: AdvantageConfig(estimator="grpo", group_size=8))
    ppo: PPOConfig = attrs.field(
        factory=lambda: PPOConfig(clip_low=0.2, clip_high=0.28, n_minibatches=8, kl_coef=0.01))
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    reward: RewardConfig = attrs.field(factory=lambda: RewardConfig(fn=None))
    eval: EvalConfig = attrs.field(factory=lambda: EvalConfig(every=10))

    def __attrs_post_init__(self):
        if self.advantage.estimator not in ("grpo", "drgrpo", "rloo", "reinforce++"):
            raise ConfigError(f"advantage.estimator: must be a critic-free estimator for recipe "
                              f"'grpo' (grpo, drgrpo, rloo, reinforce++; use recipe 'ppo' for "
                              f"gae), got {self.advantage.estimator!r}")
        if self.advantage.group_size < 2:
            raise ConfigError(f"advantage.group_size: must be >= 2 for recipe 'grpo' (answers "
                              f"per problem, compared within their group), got "
                              f"{self.advantage.group_size}")
        if self.ppo.temperature != self.rollout.temperature:
            raise ConfigError(f"ppo.temperature: must equal rollout.temperature "
                              f"({self.rollout.temperature}) so that old_logp and behav_logp "
                              f"describe the same distribution, got {self.ppo.temperature}")
        _check_rl_data(self)


@attrs.frozen
class PPORecipe(Recipe):
    """PPO with a critic and GAE on the addition task: like grpo, plus a critic (value head on
    the same tiny model) trained by critic_step; advantages from compute_values + GAE.
    ``engine.lora`` applies to the actor (as in grpo); the critic is trained in full."""

    DEFAULTS: ClassVar[dict] = {"recipe": "ppo", "steps": 20, "task": AdditionTask(),
                                "optimizer": OptimizerConfig(lr=2e-4),
                                "checkpoint": CheckpointConfig()}

    prompts_per_step: int = attrs.field(default=128, validator=integer(1))
    ref_engine: dict = attrs.field(factory=dict, hash=False)
    critic_engine: dict = attrs.field(factory=dict, hash=False)
    warmup: WarmupConfig = attrs.field(factory=WarmupConfig)
    critic_optimizer: OptimizerConfig = attrs.field(factory=lambda: OptimizerConfig(lr=1e-3))
    advantage: AdvantageConfig = attrs.field(
        factory=lambda: AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95))
    ppo: PPOConfig = attrs.field(factory=lambda: PPOConfig(n_minibatches=4, kl_coef=0.01))
    critic: CriticConfig = attrs.field(factory=lambda: CriticConfig(n_minibatches=4))
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    reward: RewardConfig = attrs.field(factory=lambda: RewardConfig(fn=None))
    eval: EvalConfig = attrs.field(factory=EvalConfig)

    def __attrs_post_init__(self):
        if self.advantage.estimator != "gae":
            raise ConfigError(f"advantage.estimator: must be 'gae' for recipe 'ppo' (it trains "
                              f"a critic), got {self.advantage.estimator!r}")
        if self.advantage.group_size != 1:
            raise ConfigError(f"advantage.group_size: must be 1 for recipe 'ppo' (one answer "
                              f"per prompt), got {self.advantage.group_size}")
        if self.ppo.temperature != self.rollout.temperature:
            raise ConfigError(f"ppo.temperature: must equal rollout.temperature "
                              f"({self.rollout.temperature}), got {self.ppo.temperature}")
        _check_rl_data(self)


@attrs.frozen
class SFTRecipe(Recipe):
    """Supervised fine-tuning on solved addition problems (sft_step), held-out loss with
    evaluate, export_hf of the result to run_dir/model (with ``engine.lora``: adapters trained, the
    model exported merged)."""

    DEFAULTS: ClassVar[dict] = {"recipe": "sft", "steps": 100, "task": AdditionTask(),
                                "optimizer": OptimizerConfig(lr=3e-3),
                                "checkpoint": CheckpointConfig(every=0)}

    batch_size: int = attrs.field(default=64, validator=integer(1))
    eval_every: int = attrs.field(default=20, validator=integer(0))
    export: bool = attrs.field(default=True, validator=boolean)
    sft: SFTConfig = attrs.field(factory=SFTConfig)

    def __attrs_post_init__(self):
        _check_model_data(self)


@attrs.frozen
class RWRecipe(Recipe):
    """Reward model (Bradley-Terry, rw_step) on pairs: the correct sum (chosen) against a near
    miss (rejected); the value head scores the last token. The reward model trains in full:
    ``engine.lora`` is refused (adapters on a critic are not supported)."""

    DEFAULTS: ClassVar[dict] = {"recipe": "rw", "steps": 60, "task": AdditionTask(digits=1),
                                "optimizer": OptimizerConfig(lr=2e-3),
                                "checkpoint": CheckpointConfig(every=0)}

    pairs_per_step: int = attrs.field(default=32, validator=integer(1))
    rw: RWConfig = attrs.field(factory=RWConfig)

    def __attrs_post_init__(self):
        if self.engine.lora is not None:
            raise ConfigError("engine.lora: the rw recipe trains its reward model in full "
                              "(adapters on a critic are not supported); must be null, got "
                              f"rank={self.engine.lora.rank}")
        _check_model_data(self)


@attrs.frozen
class DPORecipe(Recipe):
    """DPO (dpo_step) on the same pairs, against a frozen reference copy of the initial model
    (forward_logp gives ref_logp). With ``engine.lora`` the reference is the policy with its
    adapters disabled (forward_logp(..., adapters=False)): one model in memory."""

    DEFAULTS: ClassVar[dict] = {"recipe": "dpo", "steps": 60, "task": AdditionTask(digits=1),
                                "optimizer": OptimizerConfig(lr=1e-3),
                                "checkpoint": CheckpointConfig(every=0)}

    pairs_per_step: int = attrs.field(default=32, validator=integer(1))
    ref_engine: dict = attrs.field(factory=dict, hash=False)
    dpo: DPOConfig = attrs.field(factory=lambda: DPOConfig(beta=0.1))

    def __attrs_post_init__(self):
        _check_model_data(self)


RECIPE_CONFIGS = {"grpo": GRPORecipe, "ppo": PPORecipe, "sft": SFTRecipe, "rw": RWRecipe,
                  "dpo": DPORecipe}
for _cls in RECIPE_CONFIGS.values():  # fsdpfn.serde names the new home of a moved key
    _cls.__fsdpfn_moved__ = {k: f"moved to {v} (one home per setting; fsdpfn config "
                                f"{_cls().recipe} prints every key)" for k, v in MOVED.items()}
