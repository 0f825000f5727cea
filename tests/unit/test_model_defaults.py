"""A pretrained model of the user's (model.path without model.random_init) gets fine-tuning
learning rates, and the supervised recipes periodic checkpoints, wherever the file or an
override leaves them unset; the embedded task and a random init keep the recipes' own
(fsdpfn.app.recipes.model_defaults).

The expected rates are written out here, not read from the module under test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from fsdpfn.app.recipes import (RECIPE_CONFIGS, default_config, demo_config,
                                load_recipe_config)

# (optimizer, warmup.optimizer, critic_optimizer) for a pretrained model; None: no such key
FULL = {"sft": (2e-5, None, None), "rw": (1e-5, None, None), "dpo": (1e-6, None, None),
        "grpo": (1e-6, 1e-5, None), "ppo": (1e-6, 1e-5, 1e-5)}
LORA = {"sft": (2e-4, None, None), "dpo": (1e-5, None, None),
        "grpo": (1e-5, 1e-4, None), "ppo": (1e-5, 1e-4, 1e-5)}
EMBEDDED = {"sft": (3e-3, None, None), "rw": (2e-3, None, None), "dpo": (1e-3, None, None),
            "grpo": (2e-4, 2e-3, None), "ppo": (2e-4, 2e-3, 1e-3)}


def _rates(cfg) -> tuple:
    warmup = getattr(cfg, "warmup", None)
    critic = getattr(cfg, "critic_optimizer", None)
    return (cfg.optimizer.lr, warmup.optimizer.lr if warmup else None,
            critic.lr if critic else None)


@pytest.mark.parametrize("name", sorted(FULL))
def test_a_pretrained_model_gets_fine_tuning_rates(name):
    assert _rates(default_config(name, ["model.path=/models/m"])) == FULL[name]
    # everything else is the recipe's own default
    plain, tuned = default_config(name), default_config(name, ["model.path=/models/m"])
    assert tuned.optimizer.betas == plain.optimizer.betas
    assert tuned.optimizer.warmup_steps == plain.optimizer.warmup_steps


@pytest.mark.parametrize("name, every", [("sft", 100), ("rw", 100), ("dpo", 100),
                                         ("grpo", 10), ("ppo", 10)])
def test_a_pretrained_model_saves_periodically(name, every):
    assert default_config(name, ["model.path=/models/m"]).checkpoint.every == every
    assert default_config(name, ["model.path=/models/m", "checkpoint.every=7"]
                          ).checkpoint.every == 7
    assert default_config(name).checkpoint.every == (10 if name in ("grpo", "ppo") else 0)


@pytest.mark.parametrize("name", sorted(LORA))
def test_adapters_train_at_ten_times_the_rate_and_the_critic_does_not(name):
    cfg = default_config(name, ["model.path=/models/m", "engine.lora.rank=8"])
    assert _rates(cfg) == LORA[name]


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_the_embedded_task_and_a_random_init_keep_the_recipes_rates(name):
    assert _rates(default_config(name)) == EMBEDDED[name]
    assert _rates(RECIPE_CONFIGS[name]()) == EMBEDDED[name]
    random = default_config(name, ["model.path=/models/m", "model.random_init=true"])
    assert _rates(random) == EMBEDDED[name]


def test_a_rate_written_anywhere_wins(tmp_path):
    cfg = default_config("ppo", ["model.path=/models/m", "optimizer.lr=3e-6"])
    assert _rates(cfg) == (3e-6, 1e-5, 1e-5)
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({
        "recipe": "ppo", "model": {"path": "/models/m"},
        "optimizer": {"weight_decay": 0.1},             # the section written in part
        "critic_optimizer": {"lr": 5e-6},
        "warmup": {"optimizer": {"lr": 3e-5}}}))
    cfg = load_recipe_config(f)
    assert _rates(cfg) == (1e-6, 3e-5, 5e-6) and cfg.optimizer.weight_decay == 0.1
    # an override may name the model after the file: the rates follow it
    f.write_text(yaml.safe_dump({"recipe": "sft", "steps": 3}))
    assert load_recipe_config(f).optimizer.lr == 3e-3
    assert load_recipe_config(f, ["model.path=/models/m"]).optimizer.lr == 2e-5


def test_the_demo_keeps_its_rates_unless_given_a_model():
    assert _rates(demo_config()) == EMBEDDED["grpo"]
    assert _rates(demo_config(["model.path=/models/m"])) == FULL["grpo"]


@pytest.mark.timeout(120)
def test_fsdpfn_config_prints_the_rates_the_run_would_use():
    out = subprocess.run([sys.executable, "-m", "fsdpfn", "config", "grpo",
                          "model.path=/models/m"], capture_output=True, text=True, check=True)
    cfg = yaml.safe_load(out.stdout)
    assert cfg["optimizer"]["lr"] == 1e-6 and cfg["warmup"]["optimizer"]["lr"] == 1e-5


def _notes(name: str, *overrides: str) -> list[str]:
    notes: list[str] = []
    default_config(name, list(overrides), notes=notes)
    return notes


def test_the_values_chosen_for_the_model_are_named_in_one_line():
    assert _notes("sft", "model.path=/models/m") == [
        "model.path names a pretrained model: optimizer.lr=2e-05, checkpoint.every=100 (the "
        "fine-tuning defaults, where the config sets none; docs/recipes.md)"]
    # only the keys left unset are named; none at all: no line
    assert _notes("ppo", "model.path=/models/m", "optimizer.lr=3e-6",
                  "critic_optimizer.lr=2e-6") == [
        "model.path names a pretrained model: warmup.optimizer.lr=1e-05 (the fine-tuning "
        "defaults, where the config sets none; docs/recipes.md)"]
    assert _notes("grpo", "model.path=/models/m", "engine.lora.rank=8") == [
        "model.path names a pretrained model: optimizer.lr=1e-05, warmup.optimizer.lr=0.0001 "
        "(the fine-tuning defaults with LoRA, where the config sets none; docs/recipes.md)"]
    assert _notes("rw", "model.path=/models/m", "optimizer.lr=1e-5", "checkpoint.every=0") == []
    assert _notes("dpo") == [] and _notes("dpo", "model.path=/m", "model.random_init=true") == []
    notes: list[str] = []
    demo_config(notes=notes)
    assert notes == []


@pytest.mark.timeout(120)
def test_fsdpfn_config_names_them_on_stderr_and_keeps_stdout_a_config():
    out = subprocess.run([sys.executable, "-m", "fsdpfn", "config", "rw", "model.path=/models/m",
                          "checkpoint.every=5"], capture_output=True, text=True, check=True)
    assert yaml.safe_load(out.stdout)["optimizer"]["lr"] == 1e-5
    assert out.stderr == ("[fsdpfn] model.path names a pretrained model: optimizer.lr=1e-05 (the "
                          "fine-tuning defaults, where the config sets none; "
                          "docs/recipes.md)\n"), out.stderr
