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
from fsdpfn.app.recipes.model_defaults import (model_defaults_note, with_model_defaults,
                                               without_model_keys)

__all__ = ["RECIPE_CONFIGS", "NEEDS_ROLLOUT", "config_from_data", "load_recipe_config",
           "default_config", "demo_config", "run_recipe"]

NEEDS_ROLLOUT = ("grpo", "ppo")
_RUNNERS = {"grpo": "fsdpfn.app.recipes.rl:run", "ppo": "fsdpfn.app.recipes.rl:run",
            "sft": "fsdpfn.app.recipes.supervised:run_sft",
            "rw": "fsdpfn.app.recipes.supervised:run_rw",
            "dpo": "fsdpfn.app.recipes.supervised:run_dpo"}


def config_from_data(data: dict, overrides=(), *, notes: list | None = None):
    """Structure plain data (a parsed YAML) as its recipe's config class, after overrides: every
    key not written keeps the recipe's default, inside a section written in part too.
    ``notes``: a list that gets the launcher's line on the values taken from a pretrained
    model's defaults (model_defaults_note), if any."""
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
    cfg = serde.structure(serde.with_defaults(data, defaults, cls), cls)  # rates, where named
    note = model_defaults_note(name, data)
    if notes is not None and note is not None:
        notes.append(note)
    return cfg


def load_recipe_config(path: str | Path, overrides=(), *, notes: list | None = None):
    """Read a recipe YAML (or JSON) file, apply ``key.sub=value`` overrides, validate. Syntax
    errors (with their line and column) and repeated keys are ConfigErrors too. ``notes``: as
    config_from_data's."""
    return config_from_data(serde.read_config_file(path) or {}, overrides, notes=notes)


def default_config(name: str, overrides=(), *, notes: list | None = None):
    if not isinstance(name, str) or name not in RECIPE_CONFIGS:
        raise ConfigError(f"recipe: must be one of {sorted(RECIPE_CONFIGS)}, got {name!r}")
    asked = [value.strip() for key, sep, value in (o.partition("=") for o in overrides)
             if sep and key.strip() == "recipe"]
    if asked and asked[-1] != name:  # the defaults below are this recipe's keys, not the other's
        raise ConfigError(f"recipe: is the recipe named on the command line ({name!r}); run "
                          f"'fsdpfn run {asked[-1]}' for another, got {asked[-1]!r}")
    return config_from_data(without_model_keys(name, serde.unstructure(RECIPE_CONFIGS[name]())),
                            overrides, notes=notes)


def demo_config(overrides=(), *, notes: list | None = None) -> GRPORecipe:
    """The embedded demo: GRPO on 2-digit addition, 2 trainer ranks, 1 rollout server."""
    return config_from_data(without_model_keys("grpo", serde.unstructure(
        GRPORecipe(run_dir="runs/demo"))), overrides, notes=notes)


def run_recipe(cfg, ctx):
    """Run ``cfg``'s recipe on this rank (inside a torchrun job)."""
    module, fn = _RUNNERS[cfg.recipe].split(":")
    return getattr(importlib.import_module(module), fn)(cfg, ctx)
