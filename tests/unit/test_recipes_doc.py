"""docs/recipes.md is generated from the recipe config classes (fsdpfn.app.recipes.keys_doc):
the committed page must equal the generator's output, and every key must have a description."""

from __future__ import annotations

import attrs

from fsdpfn.app.recipes import RECIPE_CONFIGS, keys_doc


def test_committed_page_equals_the_generated_one():
    committed = keys_doc.PAGE.read_text()
    assert committed == keys_doc.render(), (
        "docs/recipes.md is out of date with the config classes: run "
        "`python -m fsdpfn.app.recipes.keys_doc --write` and commit the page")


def test_every_key_has_a_description():
    missing = keys_doc.undescribed()
    assert not missing, (f"describe {missing} with a comment above the field, a docstring "
                         f"sentence starting with ``key``, or NOTES in keys_notes.py")


def test_every_recipe_and_key_is_on_the_page():
    text = keys_doc.render()
    for name, cls in RECIPE_CONFIGS.items():
        assert f"### {name}\n" in text
        for a in attrs.fields(cls):
            assert f"| `{a.name}` |" in text, (name, a.name)
    for path in ("engine.fsdp.per_layer_optim_step", "engine.mb_spec.max_tokens_per_mb",
                 "ppo.old_logp_from", "rollout.max_staleness", "log.wandb.mode",
                 "engine.lora.rank"):
        assert f"| `{path}` |" in text, path


# one override breaking each rule of keys_notes.RULES, in its order, and the key it is refused by
FILES = ["model.path=/tmp", "data.train_files=[/etc/hostname]"]
BROKEN = {
    "grpo": [(["advantage.estimator=gae"], "advantage.estimator"),
             (["advantage.group_size=1"], "advantage.group_size"),
             (["prompts_per_step=2", "advantage.group_size=2", "ppo.n_minibatches=5"],
              "ppo.n_minibatches"),
             (["ppo.temperature=0.5"], "ppo.temperature"),
             ([*FILES, "warmup.steps=5"], "warmup.steps")],
    "ppo": [(["advantage.estimator=grpo"], "advantage.estimator"),
            (["advantage.group_size=2"], "advantage.group_size"),
            (["prompts_per_step=3", "critic.n_minibatches=4", "ppo.n_minibatches=1"],
             "critic.n_minibatches"),
            (["ppo.temperature=0.5"], "ppo.temperature"),
            ([*FILES, "warmup.steps=5"], "warmup.steps")],
    "rw": [(["engine.lora.rank=4"], "engine.lora")],
}


def test_each_rule_the_page_lists_is_refused_by_its_key():
    """The page's list of a recipe's own rules (keys_notes.RULES) says what is refused: each
    rule, broken by one override, is a ConfigError naming its first key."""
    import pytest

    from fsdpfn.app.recipes import default_config
    from fsdpfn.app.recipes.keys_notes import RULES
    from fsdpfn.errors import ConfigError

    assert set(RULES) == set(BROKEN)
    page = keys_doc.render()
    for recipe, rules in RULES.items():
        assert len(rules) == len(BROKEN[recipe]), recipe  # a new rule needs its case here
        for rule, (overrides, key) in zip(rules, BROKEN[recipe]):
            assert f"- {rule}\n" in page
            assert f"`{key}`" in rule, (rule, key)
            with pytest.raises(ConfigError) as info:
                default_config(recipe, overrides)
            assert str(info.value).startswith(f"{key}: "), (recipe, overrides, str(info.value))
