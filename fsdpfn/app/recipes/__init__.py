"""fsdpfn.app.recipes: ready-made training runs on an embedded task, driven by YAML configs.

    fsdpfn demo                                   # GRPO on multi-digit addition, ~3-5 min on CPU
    fsdpfn run examples/sft.yaml steps=20         # any recipe, dotted overrides
    fsdpfn config grpo                            # print a recipe's full default config

Recipes (``recipe:`` in the YAML): ``grpo`` and ``ppo`` (rollout server + push_weights every
step), ``sft``, ``rw``, ``dpo``. The task, tokenizer and tiny model are built in code
(fsdpfn.app.recipes.task); nothing is downloaded. Each recipe is a plain loop over fsdpfn's public
functions: read fsdpfn/app/recipes/rl.py and supervised.py as worked examples.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from fsdpfn import serde
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.config import RECIPE_CONFIGS, GRPORecipe
from fsdpfn.app.recipes.model_defaults import with_model_defaults, without_model_keys

__all__ = ["RECIPE_CONFIGS", "NEEDS_ROLLOUT", "config_from_data", "load_recipe_config",
           "default_config", "demo_config", "run_recipe"]

NEEDS_ROLLOUT = ("grpo", "ppo")
_RUNNERS = {"grpo": "fsdpfn.app.recipes.rl:run", "ppo": "fsdpfn.app.recipes.rl:run",
            "sft": "fsdpfn.app.recipes.supervised:run_sft",
            "rw": "fsdpfn.app.recipes.supervised:run_rw",
            "dpo": "fsdpfn.app.recipes.supervised:run_dpo"}


def config_from_data(data: dict, overrides=()):
    """Structure plain data (a parsed YAML) as its recipe's config class, after overrides: every
    key not written keeps the recipe's default, inside a section written in part too."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: must be a mapping with a 'recipe' key, got {data!r}")
    data = serde.apply_overrides(data, list(overrides))
    name = data.get("recipe")
    if "recipe" not in data:  # an empty file, or one written from a section's keys
        raise ConfigError(f"recipe: a config names its recipe first (recipe: one of "
                          f"{', '.join(RECIPE_CONFIGS)}), and this one has no recipe key "
                          f"({'it is empty' if not data else f'its keys: {sorted(data)}'}); "
                          f"'fsdpfn config grpo' prints a whole one to start from")
    if not isinstance(name, str) or name not in RECIPE_CONFIGS:
        raise ConfigError(f"recipe: must be one of {sorted(RECIPE_CONFIGS)}, got {name!r}")
    cls = RECIPE_CONFIGS[name]
    defaults = with_model_defaults(name, serde.unstructure(cls()), data)  # a pretrained model's
    return serde.structure(serde.with_defaults(data, defaults, cls), cls)  # rates, where named


def load_recipe_config(path: str | Path, overrides=()):
    """Read a recipe YAML (or JSON) file, apply ``key.sub=value`` overrides, validate. Syntax
    errors (with their line and column) and repeated keys are ConfigErrors too."""
    return config_from_data(serde.read_config_file(path) or {}, overrides)


def default_config(name: str, overrides=()):
    if not isinstance(name, str) or name not in RECIPE_CONFIGS:
        raise ConfigError(f"recipe: must be one of {sorted(RECIPE_CONFIGS)}, got {name!r}")
    asked = [value.strip() for key, sep, value in (o.partition("=") for o in overrides)
             if sep and key.strip() == "recipe"]
    if asked and asked[-1] != name:  # the defaults below are this recipe's keys, not the other's
        raise ConfigError(f"recipe: is the recipe named on the command line ({name!r}); run "
                          f"'fsdpfn run {asked[-1]}' for another, got {asked[-1]!r}")
    return config_from_data(without_model_keys(name, serde.unstructure(RECIPE_CONFIGS[name]())),
                            overrides)


def demo_config(overrides=()) -> GRPORecipe:
    """The embedded demo: GRPO on 2-digit addition, 2 trainer ranks, 1 rollout server."""
    return config_from_data(without_model_keys("grpo", serde.unstructure(
        GRPORecipe(run_dir="runs/demo"))), overrides)


def run_recipe(cfg, ctx):
    """Run ``cfg``'s recipe on this rank (inside a torchrun job)."""
    module, fn = _RUNNERS[cfg.recipe].split(":")
    return getattr(importlib.import_module(module), fn)(cfg, ctx)
