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
from fsdpfn.validators import (boolean, fail, integer, is_nonempty_str, is_port, number, one_of,
                               satisfies, seed_int, to_opt_float)
from fsdpfn.app.recipes.data import DataConfig
from fsdpfn.app.recipes.engine import MOVED, EngineSection, check_recipe_engines, optimizer_homes
from fsdpfn.app.recipes.model import ModelConfig
from fsdpfn.app.recipes.rollout_config import RolloutConfig, gpu_list, as_gpus, server_namespace
from fsdpfn.app.recipes.reward import RewardConfig
from fsdpfn.app.recipes.task import AdditionTask

__all__ = ["ModelConfig", "DataConfig", "RewardConfig", "LaunchConfig", "RolloutConfig",
           "CheckpointConfig", "LogConfig", "WandbConfig", "WarmupConfig", "EvalConfig",
           "Recipe", "GRPORecipe", "PPORecipe", "SFTRecipe", "RWRecipe", "DPORecipe", "RECIPE_CONFIGS"]


_path = satisfies("must be a non-empty path string", is_nonempty_str)
_opt_str = satisfies("must be null or a non-empty string", is_nonempty_str, optional=True)


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
    gpus: tuple[int, ...] | None = attrs.field(default=None, converter=as_gpus,
                                               validator=gpu_list)
    master_port: int | None = attrs.field(
        default=None, validator=satisfies("must be a port in 1..65535",
                                          lambda v: is_port(v) and v > 0, optional=True,
                                          section="launch."))


@attrs.frozen
class CheckpointConfig:
    """Save every ``every`` steps (0: only at the end) into run_dir/checkpoints/step_N, keeping
    the ``keep_last`` newest. A clean stop (Ctrl-C) also saves the last finished step.

    ``async_save``: a periodic save copies the state's shards to host memory and training goes
    on while a background thread writes and publishes them; at most one save is in flight (the
    next save, the end of the run and a clean stop wait for it, and the end-of-run save is
    written directly). The checkpoint holds exactly the state of its step, as a synchronous save
    would, and a crash mid-write leaves the previous checkpoint as the one ``--resume`` reads
    (a crash after the files are complete and before the rename that publishes them: --resume
    publishes that checkpoint first and continues from it).
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
    # the warm-up's loss (sft_step's SFTConfig: how its token losses are aggregated)
    sft: SFTConfig = attrs.field(factory=SFTConfig)


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
    if cfg.rollout.url is None and cfg.rollout.n_servers > rows:
        key = "rollout.servers" if cfg.rollout.servers is not None else "rollout.gpus"
        raise ConfigError(f"{key}: at most one server per answer a step asks for "
                          f"(prompts_per_step x advantage.group_size = {cfg.prompts_per_step} x "
                          f"{cfg.advantage.group_size} = {rows}; the others would have nothing "
                          f"to generate), got {cfg.rollout.n_servers} servers")
    args = cfg.rollout.server_args
    if any(a.split("=", 1)[0] == "--decode-max-len" for a in args):
        from fsdpfn.app.recipes.engine import longest_row

        cache = server_namespace(args).decode_max_len
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


# the data: keys that only data files read (data.eval_size holds the embedded task's held-out
# rows too)
FILES_ONLY = ("eval_files", "prompt_key", "answer_key", "messages_key", "response_key",
              "text_key", "chosen_key", "rejected_key", "chat_template", "system_prompt",
              "max_prompt_tokens", "max_response_tokens", "shuffle")

# the column keys a recipe does not read: set to another column, they are refused, never ignored
UNREAD_KEYS = {"grpo": ("response_key", "text_key", "chosen_key", "rejected_key"),
               "ppo": ("response_key", "text_key", "chosen_key", "rejected_key"),
               "sft": ("answer_key", "chosen_key", "rejected_key"),
               "rw": ("answer_key", "messages_key", "response_key", "text_key"),
               "dpo": ("answer_key", "messages_key", "response_key", "text_key")}
READS = {"grpo": "prompt_key or messages_key, and answer_key",
         "ppo": "prompt_key or messages_key, and answer_key",
         "sft": "messages_key, prompt_key + response_key, or text_key",
         "rw": "prompt_key + chosen_key + rejected_key",
         "dpo": "prompt_key + chosen_key + rejected_key"}


def _check_model_data(cfg) -> None:
    check_recipe_engines(cfg)
    default = type(cfg).DEFAULTS.get("task")
    if cfg.data.from_files and default is not None and cfg.task != default:
        name = next(a.name for a in attrs.fields(type(cfg.task))
                    if getattr(cfg.task, a.name) != getattr(default, a.name))
        raise ConfigError(f"task.{name}: applies to the embedded task only, and "
                          f"data.train_files is set, got {getattr(cfg.task, name)!r}")
    if not cfg.data.from_files:
        plain = DataConfig()
        name = next((n for n in FILES_ONLY if getattr(cfg.data, n) != getattr(plain, n)), None)
        if name is not None:
            raise ConfigError(f"data.{name}: applies to data files only, and data.train_files "
                              f"is not set (the embedded task reads task:), got "
                              f"{getattr(cfg.data, name)!r}")
    if cfg.data.from_files:
        plain = DataConfig()
        name = next((n for n in UNREAD_KEYS[cfg.recipe]
                     if getattr(cfg.data, n) != getattr(plain, n)), None)
        if name is not None:
            raise ConfigError(f"data.{name}: {cfg.recipe} does not read this column (it reads "
                              f"{READS[cfg.recipe]}), got {getattr(cfg.data, name)!r}")
    if cfg.recipe in ("grpo", "ppo") and cfg.data.eval_size is not None:
        raise ConfigError(f"data.eval_size: applies to sft, rw and dpo ({cfg.recipe} evaluates "
                          f"eval.n_prompts prompts), got {cfg.data.eval_size!r}")
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
    seed: int = attrs.field(default=0, validator=seed_int)
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
        if self.advantage.estimator != "gae":  # a grpo YAML made ppo: both keys, in one line
            also = ("" if self.advantage.group_size == 1 else
                    f"; advantage.group_size must then be 1 too (one answer per prompt), got "
                    f"{self.advantage.group_size}")
            raise ConfigError(f"advantage.estimator: must be 'gae' for recipe 'ppo' (it trains "
                              f"a critic), got {self.advantage.estimator!r}{also}")
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
    eval_every: int | None = attrs.field(default=20, validator=integer(0, allow=(None,)))
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
    # held-out accuracy every this many steps (null: steps // 5; 0: off)
    eval_every: int | None = attrs.field(default=None, validator=integer(0, allow=(None,)))
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
    # held-out p(correct) every this many steps (null: steps // 5; 0: off)
    eval_every: int | None = attrs.field(default=None, validator=integer(0, allow=(None,)))
    ref_engine: dict = attrs.field(factory=dict, hash=False)
    dpo: DPOConfig = attrs.field(factory=lambda: DPOConfig(beta=0.1))

    def __attrs_post_init__(self):
        _check_model_data(self)


RECIPE_CONFIGS = {"grpo": GRPORecipe, "ppo": PPORecipe, "sft": SFTRecipe, "rw": RWRecipe,
                  "dpo": DPORecipe}
# what each recipe counts a step in: a YAML copied from another recipe names the other's key
STEP_SIZE = {"grpo": ("prompts_per_step", "problems"), "ppo": ("prompts_per_step", "problems"),
             "sft": ("batch_size", "samples"), "rw": ("pairs_per_step", "pairs"),
             "dpo": ("pairs_per_step", "pairs")}


def _elsewhere(recipe: str) -> dict[str, str]:
    """{key of other recipes only: why it is not one of ``recipe``'s}, for fsdpfn.serde's
    message: the step size by this recipe's own key, any other key with the recipes it is in."""
    own = {a.name for a in attrs.fields(RECIPE_CONFIGS[recipe])}
    key, unit = STEP_SIZE[recipe]
    out = {}
    for other, cls in RECIPE_CONFIGS.items():
        for name in (a.name for a in attrs.fields(cls)):
            if name not in own:
                out.setdefault(name, []).append(other)

    def listed(names: list[str]) -> str:
        return " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))

    return {name: (f"the {recipe} recipe sizes its steps by {key} ({unit} a step)"
                   if name in {k for k, _ in STEP_SIZE.values()} else
                   f"a key of the {listed(others)} recipe{'s' * (len(others) > 1)}, not of "
                   f"{recipe} (fsdpfn config {recipe} prints its keys)")
            for name, others in out.items()}


for _name, _cls in RECIPE_CONFIGS.items():  # fsdpfn.serde names the home of a key not here
    _also = tuple((label, section) for key, label, section in (
        ("critic_optimizer", "the critic", "critic_optimizer"),
        ("warmup", "the warm-up", "warmup.optimizer")) if key in attrs.fields_dict(_cls))
    _cls.__fsdpfn_moved__ = {**{k: v for k, v in optimizer_homes(also=_also).items()
                                if k not in attrs.fields_dict(_cls)},
                             **_elsewhere(_name),
                             **{k: f"moved to {v} (one home per setting; fsdpfn config {_name} "
                                   f"prints every key)" for k, v in MOVED.items()}}
WarmupConfig.__fsdpfn_moved__ = {k: v for k, v in optimizer_homes("warmup.optimizer").items()
                                 if k not in attrs.fields_dict(WarmupConfig)}
