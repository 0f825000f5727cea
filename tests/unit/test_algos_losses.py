"""fsdpfn.algos loss factories: one naming scheme, and the same math as fsdpfn.ops's tensor losses."""

from __future__ import annotations

import pytest

import fsdpfn.algos as algos

ALGOS = ("ppo", "critic", "sft", "rw", "dpo")


@pytest.mark.parametrize("name", ALGOS)
def test_every_algorithm_has_a_loss_fn_objective_and_step(name):
    for suffix in ("_loss_fn", "_objective", "_step"):
        assert callable(getattr(algos, name + suffix)) and name + suffix in algos.__all__


@pytest.mark.parametrize("old", ["ppo_loss", "critic_loss", "rw_loss"])
def test_former_factory_names_are_aliases(old):
    assert getattr(algos, old) is getattr(algos, old + "_fn")
