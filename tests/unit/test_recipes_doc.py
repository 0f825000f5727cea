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
