"""Any single override of any recipe key, with a hostile value, either passes `fsdpfn run
--dry-run` or is refused in one line (`fsdpfn: error: ...`): never a traceback, a MemoryError or
an exit code of another kind.

Found by this sweep: a list for `recipe` (a TypeError), `rollout.servers` of 10**20 (the dry
run's server lines filled the memory), and an sft or rw checkpoint too big for its disk (the
LoRA fix it offers built a reference section those recipes do not have)."""
from __future__ import annotations

import contextlib
import io

import attrs
import pytest

from fsdpfn.app.recipes import RECIPE_CONFIGS

HOSTILE = ["abc", "-1", "0", "1e30", "nan", "inf", "[1, 2]", "{a: 1}", "null", "true", "''",
           "0.5", "-0.5", "99999999999999999999", "[]", "{}"]


def _keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a recipe config: sections and the fields under them."""
    out = []
    attrs.resolve_types(cls)
    for a in attrs.fields(cls):
        out.append(prefix + a.name)
        sub = a.type if attrs.has(a.type) else next(
            (t for t in getattr(a.type, "__args__", ()) if isinstance(t, type) and attrs.has(t)),
            None)
        if sub is not None:
            out.extend(_keys(sub, f"{prefix}{a.name}."))
    return out


KEYS = {name: _keys(cls) for name, cls in RECIPE_CONFIGS.items()}


def _dry_run(recipe: str, run_dir, *overrides: str) -> tuple[int, str]:
    from fsdpfn.app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["run", f"examples/{recipe}.yaml", "--dry-run", f"run_dir={run_dir}",
                   *overrides])
    return rc, err.getvalue()


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch, request):
    monkeypatch.chdir(request.config.rootpath)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recipe", sorted(KEYS))
def test_any_override_passes_the_dry_run_or_is_one_line(recipe, tmp_path):
    """Every key of the recipe (about 100 to 210) with each hostile value: 1,600 to 3,400 dry
    runs, 7 to 21 s a recipe."""
    bad = []
    for key in KEYS[recipe]:
        for value in HOSTILE:
            try:
                rc, err = _dry_run(recipe, tmp_path / "run", f"{key}={value}")
            except BaseException as e:  # noqa: BLE001 - what the dry run let escape
                bad.append((key, value, f"{type(e).__name__}: {e}"[:300]))
                continue
            last = err.strip().splitlines()[-1] if err.strip() else ""
            if "Traceback" in err or rc not in (0, 2) or \
                    (rc == 2 and not last.startswith("fsdpfn: error: ")):
                bad.append((key, value, f"rc={rc} {err[-300:]}"))
    assert not bad, bad[:20]


def test_what_the_sweep_found_is_refused_by_name(tmp_path, monkeypatch):
    from fsdpfn.app.recipes import preflight

    # 32 CPU servers are 17 GiB of processes: the host check is another test's (it refused this
    # dry run when the suite's other workers left less than 19 GiB of a 24 GiB host available)
    monkeypatch.setattr(preflight, "available_host_memory", lambda: 64 * 2**30)
    rc, err = _dry_run("sft", tmp_path / "r", "recipe=[1, 2]")
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "fsdpfn: error: recipe: must be one of ['dpo', 'grpo', 'ppo', 'rw', 'sft'], got [1, 2]")
    rc, err = _dry_run("grpo", tmp_path / "r", "prompts_per_step=8", "advantage.group_size=4",
                       "rollout.servers=99999999999999999999")
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "fsdpfn: error: rollout.servers: at most one server per answer a step asks for "
        "(prompts_per_step x advantage.group_size = 8 x 4 = 32; the others would have nothing "
        "to generate), got 99999999999999999999 servers")
    assert _dry_run("grpo", tmp_path / "r", "prompts_per_step=8", "advantage.group_size=4",
                    "rollout.servers=32")[0] == 0


def test_a_value_ending_in_a_colon_is_named_as_what_yaml_made_of_it(tmp_path):
    for key in ("rollout.workflow", "reward.fn", "model.path"):
        rc, err = _dry_run("grpo", tmp_path / "r", f"{key}=agents.py:")
        line = err.strip().splitlines()[-1]
        assert rc == 2 and line.startswith(f"fsdpfn: error: {key}: ") and line.endswith(
            "got {'agents.py': None} (YAML reads 'agents.py:' as a mapping: a value ending in "
            "':' lacks what follows the colon, or needs quotes)"), line
    rc, err = _dry_run("grpo", tmp_path / "r", "rollout.workflow={a: 1}")  # a real mapping
    assert rc == 2 and "YAML reads" not in err


@pytest.mark.parametrize("recipe, hint", [
    ("sft", "engine.lora.rank=16 or a run_dir on a disk with more room"),
    ("grpo", "engine.lora.rank=16 or a run_dir on a disk with more room"),
    ("rw", "a run_dir on a disk with more room"),  # its reward model takes no adapters
])
def test_a_checkpoint_too_big_for_its_disk_names_the_fixes_the_recipe_takes(recipe, hint,
                                                                            tmp_path,
                                                                            monkeypatch):
    """The refusal offers LoRA where it would fit and the recipe takes it: sft has no
    reference section for LoRA to empty (that raised a TypeError), and rw refuses adapters
    (that refusal stood in for the disk's)."""
    from fsdpfn.app.recipes import memory

    size = memory.checkpoint_bytes  # a disk with room for a LoRA state only
    monkeypatch.setattr(memory, "_free_bytes", lambda path: 1.0)
    monkeypatch.setattr(memory, "checkpoint_bytes",
                        lambda cfg, shape: 0.5 if cfg.engine.lora is not None else size(cfg, shape))
    rc, err = _dry_run(recipe, tmp_path / "r")
    line = err.strip().splitlines()[-1]
    assert rc == 2 and line.startswith("fsdpfn: error: checkpoint: one checkpoint of this run "
                                       "does not fit its disk"), err[-2000:]
    assert line.endswith(f"it would fit with {hint}"), line


def test_a_run_too_big_for_its_gpu_offers_only_what_the_recipe_takes():
    """rw's reward model takes no LoRA: its GPU refusal names the other options (LoRA's own
    refusal used to stand in for it)."""
    from fsdpfn.app.recipes import default_config
    from fsdpfn.app.recipes.memory import HEADROOM, ModelShape, check_memory, run_estimate
    from fsdpfn.errors import ConfigError

    q7 = ModelShape(hidden=3584, intermediate=18944, layers=28, vocab=152064, heads=28,
                    kv_heads=4, head_dim=128, tied=False)
    cfg = default_config("rw")
    total = run_estimate(cfg, q7, n_gpus=1, shared=False)["total"]
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, q7, n_gpus=1, capacity=total / HEADROOM - 1)
    msg = str(info.value)
    assert msg.startswith("engine: the run does not fit one GPU") and "lora" not in msg, msg
    assert "engine.optimizer_dtype=bfloat16" in msg, msg


def test_values_a_run_would_fail_on_are_refused_before_it(tmp_path):
    """Accepted by the dry run before, failing in a rank or a server after: a seed past 2**63
    (the servers' range; past 2**64 torch's generators overflow) and more threads than cores
    (torch's pool took 100,000 and crashed the process)."""
    import os

    cores = os.cpu_count() or 1
    cases = {
        "seed=9223372036854775808": "seed: must be an int in [0, 2**63), got 9223372036854775808",
        "model.seed=99999999999999999999":
            "model.seed: must be an int in [0, 2**63), got 99999999999999999999",
        "ppo.seed=-1": "ppo.seed: must be an int in [0, 2**63), got -1",
        f"launch.threads_per_rank={cores + 1}":
            f"launch.threads_per_rank: at most this host's {cores} CPU cores (more threads only "
            f"slow it down), got {cores + 1}",
        f"rollout.threads={cores + 1}":
            f"rollout.threads: at most this host's {cores} CPU cores (more threads only slow it "
            f"down), got {cores + 1}",
    }
    for override, message in cases.items():
        rc, err = _dry_run("grpo", tmp_path / "r", override)
        assert rc == 2 and err.strip().splitlines()[-1] == f"fsdpfn: error: {message}", err
    assert _dry_run("grpo", tmp_path / "r", f"seed={2**63 - 1}",
                    f"launch.threads_per_rank={cores}")[0] == 0


def test_seeds_drawn_from_the_largest_seed_stay_in_range():
    """The rollout's per-step seed and ppo's shuffle seed are seed * 1,000,003 + k, wrapped into
    [0, 2**63): the same numbers as before wherever that did not overflow."""
    import fsdpfn as ff
    from fsdpfn.errors import ConfigError
    from fsdpfn.rollout.client import generate
    from fsdpfn.validators import derived_seed

    assert derived_seed(7, 3) == 7 * 1_000_003 + 3
    top = derived_seed(2**63 - 1, 10**6)
    assert 0 <= top < 2**63 and top == ((2**63 - 1) * 1_000_003 + 10**6) % 2**63
    for cls in (ff.EngineConfig, ff.PPOConfig, ff.CriticConfig):
        kwargs = {"model_path": "m"} if cls is ff.EngineConfig else {}
        assert cls(seed=2**63 - 1, **kwargs).seed == 2**63 - 1
        with pytest.raises(ConfigError, match=r"^seed: must be an int in \[0, 2\*\*63\), got "):
            cls(seed=2**63, **kwargs)
    # grad_step's own shuffle_seed (checked before any rank steps) takes the same range
    from fsdpfn.engine.minibatch import as_order

    assert as_order(None, 2**63 - 1) is None
    for bad in (2**63, -1):
        with pytest.raises(ConfigError, match=r"^shuffle_seed: must be an int in \[0, 2\*\*63\) "
                                              r"or None, got "):
            as_order(None, bad)
    # what the servers take: a derived seed is never refused there
    with pytest.raises(ConfigError, match=r"^seed: must be null or an int in \[0, 2\*\*63\)"):
        generate("http://127.0.0.1:1", [[1]], seed=2**63)


@pytest.mark.parametrize("value", ["0", "-2", "x", "99999999999999999999"])
def test_the_servers_threads_flag_is_a_count_of_this_hosts_cores(value, capsys):
    import os

    from fsdpfn.rollout.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--port", "0", "--threads", value])
    assert (f"argument --threads: must be an int in [1, {os.cpu_count() or 1}] (this host's CPU "
            f"cores), got '{value}'") in capsys.readouterr().err
    assert parse_args(["--model", "m", "--port", "0", "--threads", "1"]).threads == 1


@pytest.mark.parametrize("recipe, overrides, key, shown", [
    ("grpo", ["prompts_per_step=200000"], "prompts_per_step",
     "prompts_per_step x advantage.group_size = 200000 x 8"),
    ("grpo", ["advantage.group_size=3000000"], "prompts_per_step",
     "prompts_per_step x advantage.group_size = 64 x 3000000"),
    ("grpo", ["warmup.batch_size=3000000"], "warmup.batch_size", "3000000"),
    ("grpo", ["eval.n_prompts=3000000"], "eval.n_prompts", "3000000"),
    ("sft", ["batch_size=3000000"], "batch_size", "3000000"),
    ("dpo", ["pairs_per_step=1500000"], "pairs_per_step", "1500000 pairs"),
])
def test_a_batch_the_host_cannot_hold_is_refused_by_name(recipe, overrides, key, shown, tmp_path,
                                                         monkeypatch):
    """A count with zeros too many drew rows for minutes (prompts_per_step=10**20 hung the
    first step) instead of a refusal: each batch a step holds, at 64 bytes a token of the
    longest row, must fit 90% of the host's available memory (here 1 GiB)."""
    from fsdpfn.app.recipes import preflight

    monkeypatch.setattr(preflight, "available_host_memory", lambda: 2**30)
    rc, err = _dry_run(recipe, tmp_path / "r", *overrides)
    line = err.strip().splitlines()[-1]
    assert rc == 2 and line.startswith(f"fsdpfn: error: {key}: one batch must fit the host's "
                                       f"memory: "), err[-2000:]
    assert "more than 90% of this host's 1.0 GiB available" in line and \
        line.endswith(f"got {shown}"), line
    # the example's own counts fit (on a host with room for the CPU ranks' own processes)
    monkeypatch.setattr(preflight, "available_host_memory", lambda: 8 * 2**30)
    assert _dry_run(recipe, tmp_path / "r")[0] == 0
