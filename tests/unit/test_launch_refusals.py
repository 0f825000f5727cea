"""What the trainer ranks would refuse once started is refused before launch, in one line that
names the key, the rule and the value (`fsdpfn run ... --dry-run`, exit 2; the main job's
audit found each of these surfacing in a rank after the server had started, or as a
traceback), and the supervised recipes' engine draws under the run's `seed`.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from fsdpfn.app import cli
from fsdpfn.app.recipes import default_config
from fsdpfn.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "workflows.py"
CPU = ["launch.device=cpu", "log.progress=false"]


@pytest.mark.parametrize("recipe,overrides,line", [
    ("grpo", ["model.num_heads=3", "model.hidden_size=96", "model.num_kv_heads=1",
              "parallel.tp=2", "launch.nproc=2"],
     "parallel.tp: must divide the model's num_attention_heads (3, model.num_heads), got tp=2"),
    ("grpo", ["model.num_heads=8", "model.num_kv_heads=3"],
     "model.num_kv_heads: the attention heads must be a whole number of kv heads each, got 8 "
     "heads on 3 kv heads"),
    ("grpo", ["prompts_per_step=1", "launch.nproc=2", "ppo.n_minibatches=1"],
     "prompts_per_step: must be >= the 2 data-parallel ranks (each rank trains whole groups of "
     "a step), got 1"),
    ("sft", ["batch_size=1", "launch.nproc=2"],
     "batch_size: must be >= the 2 data-parallel ranks (each rank trains whole rows of a step), "
     "got 1"),
    ("grpo", ["engine.attn_impl=varlen"],
     "engine.attn_impl: 'varlen' needs CUDA and this run's trainer is on cpu (launch.device), "
     "got 'varlen'"),
    ("grpo", ["engine.logprobs_impl=liger"],
     "engine.logprobs_impl: 'liger' needs CUDA and this run's trainer is on cpu "
     "(launch.device), got 'liger'"),
    ("sft", ["engine.lora.rank=4", "engine.lora.target_modules=[nope_proj]"],
     "engine.lora.target_modules: must name linear layers of the decoder layers (['down_proj', "
     "'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']) or be ['all-linear'], "
     "got ['nope_proj']"),
    ("grpo", ["launch.master_port=70000"],
     "launch.master_port: must be a port in 1..65535, got 70000"),
    ("grpo", [f"rollout.workflow={EXAMPLES}:check_and_retry", "advantage.reward_scale=3.0"],
     "advantage.reward_scale: not applied to workflow episodes (their advantages are the group "
     "statistics alone), got 3.0; use ppo.kl_coef for a KL term"),
    # shard_model's rule, once met only inside the started ranks
    ("sft", ["engine.fsdp.wrap_policy=[NoSuchLayer]"],
     "engine.fsdp.wrap_policy: must name module classes of the model (e.g. "
     "['Qwen2DecoderLayer']), got ['NoSuchLayer']"),
    ("grpo", ["ref_engine.fsdp.wrap_policy=[Qwen2DecoderLayer, Nope]"],
     "ref_engine.fsdp.wrap_policy: must name module classes of the model (e.g. "
     "['Qwen2DecoderLayer']), got ['Nope']"),
    # a head size the rotary embedding cannot turn: the first forward failed deep inside
    ("sft", ["model.hidden_size=24"],
     "model.hidden_size: must be num_heads (8) x an even head size (the rotary embedding turns "
     "pairs of a head's dimensions), got 24"),
    ("sft", ["model.num_heads=3"],
     "model.num_heads: must divide hidden_size (128) into heads of an even size (the rotary "
     "embedding turns pairs of a head's dimensions), got 3"),
    ("sft", ["parallel.cp=3"],
     "parallel.cp: tp x cp = 1 x 3 = 3 must divide the 2 trainer ranks (launch.nproc), got "
     "cp=3"),
    ("sft", ["recipe=dpo"],
     "recipe: is the recipe named on the command line ('sft'); run 'fsdpfn run dpo' for "
     "another, got 'dpo'"),
])
def test_what_a_rank_would_refuse_is_one_line_before_launch(tmp_path, capsys, recipe,
                                                             overrides, line):
    run_dir = tmp_path / "run"
    rc = cli.main(["run", recipe, f"run_dir={run_dir}", *CPU, *overrides, "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"fsdpfn: error: {line}\n", err
    assert not run_dir.exists()


@pytest.mark.parametrize("value", ["5", "[1, 2]", "''"])
def test_a_system_prompt_is_a_string(value):
    with pytest.raises(ConfigError, match=r"^data.system_prompt: must be a non-empty "
                                          r"string, got "):
        default_config("sft", [f"data.system_prompt={value}"])


@pytest.mark.parametrize("recipe", ["sft", "rw", "dpo"])
def test_the_supervised_engines_draw_under_the_runs_seed(tmp_path, recipe):
    """The run's `seed` is documented as the model's random init (a value head, adapters,
    random_init weights); the supervised recipes once drew under `model.seed`, the embedded
    model's own, as grpo and ppo never did."""
    import fsdpfn as ff
    from fsdpfn.app.recipes import supervised

    cfg = default_config(recipe, ["seed=7", "model.seed=5"])
    ctx = types.SimpleNamespace(run_dir=tmp_path, device="cpu")
    engine = supervised._engine(cfg, ctx, optimizer=ff.OptimizerConfig(), critic=recipe == "rw")
    assert engine.seed == 7


def test_every_push_option_is_reachable_from_yaml(tmp_path):
    """rollout.push holds fsdpfn.PushConfig's options less the four the recipe owns, with
    PushConfig's defaults, and each value set in YAML reaches the PushConfig the run pushes
    with (only transport, timeout_s, pause_generation and disk_root did, timeout_s from the
    generation requests' rollout.timeout_s)."""
    import attrs

    import fsdpfn as ff
    from fsdpfn.app.recipes.rl import push_config
    from fsdpfn.app.recipes.rollout_config import PUSH_OWNED, PushSection

    ours = {a.name: a.default for a in attrs.fields(PushSection)}
    theirs = {a.name: a.default for a in attrs.fields(ff.PushConfig) if a.name not in PUSH_OWNED}
    assert ours == theirs and set(PUSH_OWNED) <= {a.name for a in attrs.fields(ff.PushConfig)}
    values = {"dtype": "bfloat16", "bucket_bytes": 1 << 20, "edge_bucket_bytes": None,
              "backend": "gloo", "timeout_s": 42.0, "init_timeout_s": 7.0,
              "flush_cache": False, "precheck": False, "keep_last": 3,
              "master_address": "10.0.0.5", "master_port": 29123, "group_name": "mine",
              "pause_mode": "retract", "probe_tol": 0.5}
    assert set(values) == set(ours)
    cfg = default_config("grpo", [f"rollout.push.{k}={'null' if v is None else v}"
                                  for k, v in values.items()] + ["rollout.timeout_s=11"])
    built = push_config(cfg, "disk", tmp_path)
    assert {k: getattr(built, k) for k in values} == values
    assert built.transport == "disk" and built.disk_root == tmp_path / "push"
    assert built.pause_generation is True  # max_staleness 0: the synchronous loop


@pytest.mark.parametrize("override,line", [
    ("rollout.push.transport=disk",
     "rollout.push.transport: not a key here, set by rollout.transport"),
    ("rollout.push.timeout_s=0", "rollout.push.timeout_s: must be > 0, got 0.0"),
])
def test_push_keys_the_recipe_owns_or_bad_values_are_refused_by_name(override, line):
    with pytest.raises(ConfigError) as info:
        default_config("grpo", [override])
    assert str(info.value).startswith(line), str(info.value)


@pytest.mark.parametrize("recipe,overrides,line", [
    ("sft", ["model.path=/tmp", "model.hidden_size=4096"],
     "model.hidden_size: applies to the embedded model only (model.path's config.json sets the "
     "shape; the run's seed the init of random_init), got 4096"),
    ("sft", ["model.random_init=true"],
     "model.random_init: must be false without model.path (the embedded model is always built "
     "fresh, under model.seed), got True"),
    ("grpo", ["rollout.max_episode_tokens=64"],
     "rollout.max_episode_tokens: applies to rollout.workflow's episodes only, and no workflow "
     "is set, got 64"),
    ("sft", ["model.path=/tmp", "data.train_files=[/etc/hostname]", "task.digits=3"],
     "task.digits: applies to the embedded task only, and data.train_files is set, got 3"),
    ("grpo", ["data.max_response_tokens=100000"],
     "data.max_response_tokens: applies to data files only, and data.train_files is not set "
     "(the embedded task reads task:), got 100000"),
    ("sft", ["data.eval_files=[/etc/hostname]"],
     "data.eval_files: applies to data files only, and data.train_files is not set (the "
     "embedded task reads task:), got ('/etc/hostname',)"),
    ("ppo", ["data.eval_size=3"],
     "data.eval_size: applies to sft, rw and dpo (ppo evaluates eval.n_prompts prompts), got 3"),
    ("sft", ["model.path=/tmp", "data.train_files=[/etc/hostname]", "data.answer_key=solution"],
     "data.answer_key: sft does not read this column (it reads messages_key, prompt_key + "
     "response_key, or text_key), got 'solution'"),
    ("sft", ["model.path=/tmp", "data.train_files=[/etc/hostname]", "data.chosen_key=good"],
     "data.chosen_key: sft does not read this column (it reads messages_key, prompt_key + "
     "response_key, or text_key), got 'good'"),
    ("dpo", ["model.path=/tmp", "data.train_files=[/etc/hostname]", "data.response_key=out"],
     "data.response_key: dpo does not read this column (it reads prompt_key + chosen_key + "
     "rejected_key), got 'out'"),
    ("rw", ["model.path=/tmp", "data.train_files=[/etc/hostname]", "data.messages_key=conv"],
     "data.messages_key: rw does not read this column (it reads prompt_key + chosen_key + "
     "rejected_key), got 'conv'"),
    ("grpo", ["model.path=/tmp", "data.train_files=[/etc/hostname]", "warmup.steps=0",
              "data.rejected_key=bad"],
     "data.rejected_key: grpo does not read this column (it reads prompt_key or messages_key, "
     "and answer_key), got 'bad'"),
])
def test_keys_that_would_have_no_effect_are_refused_by_name(recipe, overrides, line):
    """Keys for the other kind of model, data or loop were accepted and silently unused."""
    with pytest.raises(ConfigError) as info:
        default_config(recipe, overrides)
    assert str(info.value) == line


def test_the_warm_ups_loss_and_the_pair_recipes_eval_cadence_have_keys():
    """The warm-up's sft_step took SFTConfig() and rw/dpo evaluated every steps // 5 with no
    key for either."""
    from fsdpfn.app.recipes.supervised import _eval_every

    assert default_config("grpo", ["warmup.sft.agg=seq-mean-token-sum"]).warmup.sft.agg == \
        "seq-mean-token-sum"
    for recipe in ("rw", "dpo"):
        assert _eval_every(default_config(recipe, ["steps=60"])) == 12
        assert _eval_every(default_config(recipe, ["steps=60", "eval_every=7"])) == 7
        assert _eval_every(default_config(recipe, ["eval_every=0"])) == 0


@pytest.mark.parametrize("role,raised,line", [
    ("ref_engine", "fsdp.wrap_policy: must name module classes of the model, got ['X']",
     "ref_engine.fsdp.wrap_policy: must name module classes of the model, got ['X']"),
    ("critic_engine", "lora: a critic takes no adapters, got 4",
     "critic_engine.lora: a critic takes no adapters, got 4"),
    ("engine", "ParallelStrategy.tp: must divide the model's num_key_value_heads (3), got tp=2",
     "parallel.tp: must divide the model's num_key_value_heads (3), got tp=2"),
    ("engine", "model_type: 'mpt' is not supported: ALiBi positions",
     "model.path: model_type: 'mpt' is not supported: ALiBi positions"),
    ("engine", "model_path: no config.json in /x, got '/x'",
     "model.path: no config.json in /x, got '/x'"),
    ("engine", "loss_fn: must return a pair, got 3", "loss_fn: must return a pair, got 3"),
])
def test_a_rank_side_engine_error_names_the_yaml_key(role, raised, line):
    """The engine names its own fields (`fsdp.wrap_policy`, `ParallelStrategy.tp`,
    `model_type`); a rank of the main job re-raises such an error under the YAML key that sets
    it, and leaves any other message as it was."""
    from fsdpfn.app.recipes.engine import yaml_named

    assert str(yaml_named(role, ConfigError(raised))) == line


def test_a_dry_run_refuses_a_run_dir_holding_a_previous_run_and_changes_nothing(tmp_path,
                                                                              capsys):
    """--dry-run runs the run_dir's check too (it used to pass where the run was refused), and
    with --overwrite it reports without clearing anything."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    rc = cli.main(["run", "sft", f"run_dir={run_dir}", *CPU, "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"fsdpfn: error: run_dir: {str(run_dir)!r} holds a "
                                      f"previous run (metrics.jsonl"), err
    rc = cli.main(["run", "sft", f"run_dir={run_dir}", *CPU, "--dry-run", "--overwrite"])
    capsys.readouterr()
    assert rc == 0
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_an_objectives_options_are_keyword_only():
    import fsdpfn as ff

    with pytest.raises(TypeError):
        ff.Objective(lambda outputs, mb, ctx: None, "sequences")
    assert ff.Objective(lambda outputs, mb, ctx: None, normalizer="sequences").why == {}


def test_launch_gpus_on_a_cpu_trainer_is_refused_not_ignored():
    """rollout.gpus where it cannot apply was refused; launch.gpus placed nothing, silently."""
    from fsdpfn.app.recipes.placement import place

    cfg = default_config("sft", ["launch.gpus=[0]"])
    with pytest.raises(ConfigError) as info:
        place(cfg, 0, needs_rollout=False)
    assert str(info.value) == ("launch.gpus: places trainer ranks on CUDA GPUs, and this run's "
                               "trainer is on the CPU (this host has none), got [0]")
    cfg = default_config("sft", ["launch.gpus=[0]", "launch.device=cpu"])
    with pytest.raises(ConfigError, match=r"\(launch.device is 'cpu'\), got \[0\]$"):
        place(cfg, 2, needs_rollout=False)


@pytest.mark.parametrize("text, line", [
    ("run_dir: !!binary aGVsbG8=\n",
     "run_dir: must be a string, number, bool, null, list or mapping, got bytes b'hello'"),
    ("log: {tags: !!set {a, b}}\n", "log.tags: must be a string, number, bool, null, list or "
                                    "mapping, got set "),
    ("data: {train_files: [!!timestamp 2024-01-01]}\n", "data.train_files[0]: must be a string, "
                                                         "number, bool, null, list or mapping, "
                                                         "got date datetime.date(2024, 1, 1)"),
])
def test_a_yaml_value_of_no_plain_type_is_one_line(tmp_path, capsys, text, line):
    """Explicit YAML tags made values that JSON cannot hold: a traceback from inside the
    override step, exit 1."""
    path = tmp_path / "c.yaml"
    path.write_text("recipe: sft\n" + text)
    rc = cli.main(["config", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"fsdpfn: error: {line}") and err.count("\n") == 1, err


@pytest.mark.parametrize("command, given, hint", [
    ("config", "gpro", "; did you mean 'grpo'?"), ("run", "dop", "; did you mean 'dpo'?"),
    ("run", "runs/missing/config.yaml", ""), ("config", "nope", "")])
def test_a_config_that_is_neither_a_recipe_nor_a_file_is_one_line(tmp_path, capsys, command,
                                                                    given, hint):
    """``fsdpfn run NAME`` takes a recipe name or a file: a misspelt name read 'file does not
    exist'; now both readings are named, with the closest recipe."""
    rc = cli.main([command, given, f"run_dir={tmp_path / 'r'}", "--dry-run"] if command == "run"
                  else [command, given])
    err = capsys.readouterr().err
    assert rc == 2 and err == (
        f"fsdpfn: error: config: must be a recipe name (grpo, ppo, sft, rw, dpo) or an existing "
        f"YAML or JSON file, got {given!r} (no such file{hint})\n"), err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text, keys", [("", "it is empty"), ("# nothing yet\n", "it is empty"),
                                        ("steps: 3\nppo: {clip_low: 0.1}\n",
                                         "its keys: ['ppo', 'steps']")])
def test_a_config_without_a_recipe_key_says_so(tmp_path, capsys, text, keys):
    """An empty file (or one holding only a section's keys) read 'recipe: must be one of [...],
    got None'."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert cli.main(["config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"fsdpfn: error: recipe: a config names its recipe first (recipe: one of grpo, ppo, sft, "
        f"rw, dpo), and this one has no recipe key ({keys}); 'fsdpfn config grpo' prints a "
        f"whole one to start from\n")
    assert cli.main(["config", str(path), "recipe=ppo"]) == 0  # named by an override: fine
    assert capsys.readouterr().out.startswith("recipe: ppo")


def test_a_recipe_name_beside_a_directory_of_that_name_is_the_recipe(tmp_path, capsys,
                                                                      monkeypatch):
    """A run_dir named after its recipe (``run_dir=grpo``) in the working directory made the
    next ``fsdpfn run grpo`` read 'config: file is a directory'; a directory is no config file,
    so the name is the recipe's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "grpo").mkdir()
    assert cli.main(["config", "grpo"]) == 0
    assert capsys.readouterr().out.startswith("recipe: grpo"), "the recipe's defaults"


def test_a_date_written_in_yaml_is_the_text_written(tmp_path):
    """No config field holds a date: a run_dir or model directory named 2024-01-01 is a path
    (YAML 1.1's implicit timestamps made it a datetime.date, and a traceback)."""
    from fsdpfn.app.recipes import load_recipe_config

    path = tmp_path / "c.yaml"
    path.write_text("recipe: sft\nrun_dir: 2024-01-01\nlog: {wandb: {name: 2024-01-01 10:00}}\n")
    cfg = load_recipe_config(path, ["model.path=2025-02-03"])
    assert (cfg.run_dir, cfg.model.path, cfg.log.wandb.name) == ("2024-01-01", "2025-02-03",
                                                               "2024-01-01 10:00")


def test_every_column_key_is_read_or_refused_by_each_recipe():
    """config.UNREAD_KEYS and READS partition data's column keys for every recipe: a new
    column key must be placed (read, or refused when set) for each."""
    import attrs

    from fsdpfn.app.recipes.config import READS, UNREAD_KEYS
    from fsdpfn.app.recipes.data import DataConfig

    keys = {a.name for a in attrs.fields(DataConfig) if a.name.endswith("_key")}
    for recipe in ("grpo", "ppo", "sft", "rw", "dpo"):
        read = {k for k in keys if k in READS[recipe]}
        assert read | set(UNREAD_KEYS[recipe]) == keys, recipe
        assert not read & set(UNREAD_KEYS[recipe]), recipe
